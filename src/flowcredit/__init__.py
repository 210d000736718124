"""flowcredit: RL fine-tuning of flow-matching text-to-image models with step-level credit assignment."""

__version__ = "0.1.0"
