"""The training configuration: nested dataclasses, one per component, each field with a help sentence.

Presets live in `flowcredit/configs/*.yaml`; `flowcredit train [PRESET|file.yaml] key=value ...` loads one,
applies overrides, rejects unknown keys with a suggestion, and saves the resolved config in the run folder.
Every numeric field declares its range in its metadata (`_h(..., ge=0)`; config/load.py checks every value it reads
against it and names the key, the value and where it was set). Only cross-field checks are in `__post_init__`, and
they state the arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from .build import check_values
from .credit import CreditCfg
from .fields import _h
from .registry import REGISTRIES, options_field
from .run import DistCfg, FaultsCfg, RunCfg


@dataclass
class ModelCfg:
    name: str = _h("tiny", "Model family (registry flowcredit.models.factory.MODELS): the built-in tiny shapes model, "
        "sd3 (SD3/SD3.5) or flux (FLUX.1), both through diffusers; see --help-config.")
    path: str | None = _h(None, "Weights: a .safetensors file (tiny) or a local diffusers folder; null = the shipped "
        "tiny checkpoint.")
    precision: Literal["auto", "fp32", "bf16"] = _h("auto", "Autocast dtype of the network forward/backward; step "
        "math is always fp32. auto = bf16 where the hardware runs it fast (GPU with bf16, CPU with AVX-512/AMX), else "
        "fp32 (models/precision.py).")
    trainable: Literal["all", "lora", "blocks", "modulation"] = _h("all", "What RL trains: all weights (full "
        "fine-tune), LoRA adapters (peft; base weights frozen, π_ref = adapter disabled), the transformer blocks only "
        "(tiny: text encoder and embeddings frozen), or the conditioning path only: the adaLN modulation layers and "
        "the timestep/pooled-text embeddings (docs/ALGORITHMS.md §9.4; where the gradient's signal is, measured by "
        "benchmarks/bench_grad_noise.py).")
    lora_rank: int = _h(32, "LoRA rank r (ALGORITHMS.md A9: r32).", ge=1)
    lora_alpha: float = _h(64.0, "LoRA alpha (A9: α64).", gt=0)
    lora_targets: list[str] | None = _h(None, "Module names LoRA wraps; null = the family default (SD3: flow_grpo's "
        "attention projections; tiny: the blocks' qkv, proj, mlp.0, mlp.2).")
    gradient_checkpointing: bool = _h(False, "Recompute activations in the backward pass to save memory (real "
        "models).")
    options: dict[str, Any] = options_field("model", "Options of the model family, checked against its own options "
        "dataclass (sd3: {resolution, max_sequence_length}; flux: also embedded_guidance; listed by --help-config).")

    def __post_init__(self):
        if self.lora_targets is None:
            self.lora_targets = []
        reg = REGISTRIES.get("model")  # models/factory.py; a loaded config was checked against it already
        if reg is not None:
            reg.options(reg.spec(self.name), self.options)  # unknown family or option: one-line ValueError


@dataclass
class SamplerParams:
    """What a step function reads (samplers/sde.py): which sampler, its noise level, the log-prob reduction and the
    sampler's own options. The base of SamplerCfg, so the config's `sampler:` section IS the step parameters (one
    definition); `samplers.sde.SamplerParams` is this class. Built in code: ``SamplerParams("ddim_sde",
    options={"sigma": "eta_s"})``."""

    name: str = _h("flow_sde", "Rollout sampler (registry flowcredit.samplers.sde.SAMPLERS, ALGORITHMS.md §2): "
        "Flow-GRPO's flow_sde, Stepwise's ddim_sde, Flow-CPS cps, or ode; see --help-config.")
    noise_level: float | None = _h(None, "a for flow_sde/cps (Flow-GRPO a=0.7), η for ddim_sde (0.9); null = the "
        "sampler's default.", ge=0)
    reduce: Literal["mean", "sum"] = _h("mean", "Log-prob reduction over latent dims (Flow-GRPO: mean, so clip_range "
        "1e-4 means what it means there).")
    options: dict[str, Any] = options_field("sampler", "Options of the chosen sampler, checked against its own "
        "options dataclass (ddim_sde: {sigma, coef}; listed by --help-config).")

    def __post_init__(self):
        check_values(self, "sampler")  # choices and ranges of an object built in code (the loader checked its own)
        reg = REGISTRIES.get("sampler")  # samplers/sde.py; a loaded config was checked against it already
        if reg is not None:
            reg.options(reg.spec(self.name), self.options)  # unknown name or option: one-line ValueError


@dataclass
class SamplerCfg(SamplerParams):
    """The `sampler:` section: the step parameters (SamplerParams) + the time grid and which steps are trained."""

    num_steps: int = _h(10, "Rollout steps T (Flow-GRPO: 10 for training).", ge=1)
    shift: float = _h(3.0, "SD3 timestep shift of the time grid.", gt=0)
    grid: Literal["uniform", "diffusers", "model"] = _h("uniform", "Time grid: shifted linspace(1, 0), diffusers' "
        "FlowMatchEulerDiscreteScheduler grid at sampler.shift, or model = the model's own scheduler sigmas "
        "(model.time_grid: its dynamic shift / terminal stretch, what its pipeline steps on; diffusers families only, "
        "sampler.shift unused).")
    guidance_scale: float = _h(1.0, "CFG scale used in rollout AND loss (one policy velocity function).", ge=0)
    timestep_fraction: float = _h(0.99, "Train the first int(T·fraction) steps (Flow-GRPO 0.99 → 9 of 10). Steps with "
        "σ=0 are never trained.", gt=0, le=1)
    ode_untrained: bool = _h(True, "Sample the steps that are never trained (j ≥ int(T·timestep_fraction)) with the "
        "ODE, so no exploration noise stays in the final image; false = Flow-GRPO's code (SDE on every step).")
    train_steps_per_sample: int = _h(0, "If > 0, train only this many randomly chosen trainable steps per sample each "
        "iteration (a speed lever); 0 = all.", ge=0)
    train_step_draw: Literal["random", "systematic", "nft", "awm"] = _h("random", "How sampler.train_steps_per_sample "
        "= k steps of the n trainable ones are drawn: random = k uniformly without replacement; systematic = u ~ U[0, "
        "n/k), steps ⌊u + i·n/k⌋ for i < k: every step is still trained with probability k/n (the same objective in "
        "expectation), but each sample's steps are spread over the whole time range (docs/ALGORITHMS.md §9.1); nft = "
        "DiffusionNFT's draw (objective nft/awm, train_steps_per_sample 0): int(T·timestep_fraction) of ALL T grid "
        "times per sample, uniformly without replacement, so every time, the last one included, is trained with "
        "probability int(T·fraction)/T (9 of 10: 0.9) (§9.2); awm = AWM's stratified draw (time_type "
        "discrete_wo_init): with n = int(T·timestep_fraction), one step from each of the k strata [⌊1 + i(n−1)/k⌋, ⌊1 "
        "+ (i+1)(n−1)/k⌋), i < k, so step 0 is never trained (1 ≤ k ≤ n − 1; 14 steps, 0.9, k 6: {1}, {2,3}, {4,5}, "
        "…, {10,11}); drawn per sample, per prompt group with crn (§9.3).")
    shared_noise: bool | None = _h(None, "Share x_T within a group; null = the method's default (stepwise/vgpo: yes, "
        "flow_grpo: no).")

    def __post_init__(self):
        super().__post_init__()
        if int(self.num_steps * self.timestep_fraction) < 1:
            raise ValueError(
                f"int(sampler.num_steps·sampler.timestep_fraction) = int({self.num_steps}·{self.timestep_fraction}) = "
                "0 trainable steps; raise sampler.num_steps or sampler.timestep_fraction"
            )
        if self.train_step_draw == "nft" and self.train_steps_per_sample > 0:
            k = self.train_steps_per_sample
            raise ValueError(
                "sampler.train_step_draw=nft trains int(T·timestep_fraction) of all T steps per sample (DiffusionNFT) "
                f"and takes no count, but sampler.train_steps_per_sample={k}: set it to 0 (or use "
                f"train_step_draw=random with timestep_fraction=1 for {k} of all T)"
            )
        n_ok = int(self.num_steps * self.timestep_fraction)
        if self.train_step_draw == "awm" and not 1 <= self.train_steps_per_sample <= n_ok - 1:
            raise ValueError(
                "sampler.train_step_draw=awm draws one step from each of sampler.train_steps_per_sample strata of "
                f"steps 1..{n_ok - 1} (int(sampler.num_steps·sampler.timestep_fraction) − 1, step 0 never trained), "
                "but "
                f"train_steps_per_sample={self.train_steps_per_sample}; use 1 to {n_ok - 1}"
                + (" or raise sampler.num_steps" if n_ok < 2 else "")
            )


@dataclass
class DataCfg:
    train_prompts: str = _h("shapes:train", "Training prompts: shapes:train, or a .jsonl (GenEval schema) / .txt "
        "prompt file.")
    prompts_per_iter: int = _h(8, "Distinct prompts per iteration (groups).", ge=1)
    group_size: int = _h(8, "Samples per prompt G (GRPO group; group-relative advantages need 2).", ge=2)
    batch_size: int | None = _h(None, "Samples per iteration B; if set it must be divisible by group_size and sets "
        "prompts_per_iter = B / G.", ge=1)
    balance_tags: bool = _h(True, "For GenEval-schema prompts: draw the tag uniformly, then a prompt of that tag "
        "(Flow-GRPO mixes tasks by weight).")
    tag_weights: dict[str, float] | None = _h(None, "With balance_tags: relative weight of each tag when drawing it, "
        "e.g. {single_object: 0, position: 2}; tags not named keep weight 1, weight 0 drops a tag; null = uniform.")

    def __post_init__(self):
        # Ranges hold here (group_size >= 2, batch_size >= 1), so a divisible batch_size gives prompts_per_iter >= 1.
        if self.batch_size is not None:
            if self.batch_size % self.group_size != 0:
                raise ValueError(
                    f"data.batch_size={self.batch_size} is not divisible by data.group_size={self.group_size}; use a "
                    f"multiple of {self.group_size} (e.g. "
                    f"{self.group_size * max(1, round(self.batch_size / self.group_size))})"
                )
            self.prompts_per_iter = self.batch_size // self.group_size
        if self.tag_weights is not None:
            bad = {k: v for k, v in self.tag_weights.items() if not v >= 0}
            if bad:
                raise ValueError(f"data.tag_weights: weights must be >= 0, got {bad}")
            if not self.balance_tags:
                raise ValueError(
                    "data.tag_weights needs data.balance_tags=true (tags are drawn first, then a prompt of the tag)"
                )


@dataclass
class RewardComponent:
    name: str = _h("shapes", "Registered reward name or 'module:Class'.")
    weight: float = _h(1.0, "Weight in the mix (any real number; a negative weight penalizes the reward).")
    options: dict[str, Any] = _h(dict, "Constructor options of this reward (e.g. a local model path).")
    label: str | None = _h(None, "Name of this component in the logs; null = the reward name.")


@dataclass
class RewardCfg:
    name: str = _h("shapes", "Registered reward (`flowcredit.rewards.registry`), or 'mix' to use `components`.")
    options: dict[str, Any] = _h(dict, "Constructor options of the reward (e.g. {model: /path/to/local/pickscore}).")
    components: list[RewardComponent] = _h(None, "For name=mix: weighted rewards, e.g. [{name: shapes, weight: 0.8}, "
        "...].")
    normalize: Literal["none", "batch", "group", "running"] = _h("none", "For mixes: z-normalize each component "
        "before the weighted sum (GDPO-style): over the batch, per prompt group, or with running statistics.")

    def __post_init__(self):
        if self.components is None:
            self.components = []


@dataclass
class EstimateCfg:
    substeps: int = _h(5, "T′: Euler substeps of the x̂0 estimate of each state (Stepwise §1.3; 1 = Tweedie).", ge=1)
    chunk_size: int = _h(128, "States per batched model call when computing x̂0 estimates.", ge=1)
    instant_substeps: int = _h(1, "VGPO instant reward: substeps of the post-action estimate (1 = one-step Tweedie, "
        "§5.2).", ge=1)


@dataclass
class ObjectiveCfg:
    name: str = _h("grpo", "Training objective (registry `flowcredit.objectives`): grpo = PPO-clip on SDE log-probs "
        "(Flow-GRPO), nft = DiffusionNFT's forward-process loss, awm = advantage-weighted flow matching.")
    options: dict[str, Any] = options_field("objective", "Options of the chosen objective, checked against its own "
        "options dataclass (listed by --help-config; docs/ALGORITHMS.md §9).")


@dataclass
class OptimCfg:
    lr: float = _h(3e-5, "AdamW learning rate.", gt=0)
    betas: list[float] = _h(None, "AdamW betas (each in [0, 1)); null = [0.9, 0.999].", ge=0, lt=1)
    weight_decay: float = _h(1e-4, "AdamW weight decay (Flow-GRPO 1e-4).", ge=0)
    eps: float = _h(1e-8, "AdamW epsilon.", gt=0)
    grad_clip: float = _h(1.0, "Max gradient norm.", gt=0)
    clip_range: float = _h(1e-4, "PPO ratio clip ε (Flow-GRPO code 1e-4, with mean-reduced log-probs).", gt=0)
    kl_beta: float = _h(0.0, "β of the KL to the reference model (Flow-GRPO: 0.04 GenEval); 0 skips the reference "
        "forward.", ge=0)
    kl_reference: Literal["initial", "ema"] = _h("initial", "The KL reference π_ref: initial = the weights the run "
        "started from (Flow-GRPO; for LoRA the disabled adapter); ema = a slow EMA of the policy, ref ← d·ref + (1 − "
        "d)·θ after every optimizer step with d = optim.kl_reference_decay, so the KL damps step-to-step noise "
        "without pinning the model to its start (docs/ALGORITHMS.md §9.4; keeps a full copy of the model, also for "
        "LoRA).")
    kl_reference_decay: float = _h(0.98, "Decay d of the EMA reference (optim.kl_reference=ema), per optimizer "
        "step.", gt=0, lt=1)
    kl_reference_decay_rate: float = _h(0.0, "optim.kl_reference=ema: 0 = the constant decay "
        "optim.kl_reference_decay; r > 0 = the ramp d_k = min(r·k, optim.kl_reference_decay) at the k-th optimizer "
        "step (AWM's released recipe, kl_ema_decay_type=linear: min(0.001·k, 0.3); docs/ALGORITHMS.md §9.3).", ge=0)
    kl_base_beta: float = _h(0.0, "β_base of a SECOND KL term, to the initial weights (for LoRA the model with its "
        "adapter disabled, else a frozen copy), added to the one of optim.kl_beta to the EMA reference of "
        "optim.kl_reference=ema: L += kl_base_beta·mean_d (v_θ − v_base)² per pair (objective nft/awm, velocity "
        "space, same pairs as the other KL). AWM's released recipe: 1e-3 (train.beta) beside ema_beta 1 "
        "(docs/ALGORITHMS.md §9.3). 0 = no second term, no extra forward.", ge=0)
    lr_schedule: Literal["constant", "cosine", "linear"] = _h("constant", "Learning-rate schedule over the run's "
        "progress p = max(iteration / N, fraction of the training time of run.budget_minutes used), N = "
        "min(run.iterations, optim.lr_decay_iterations if > 0): constant, cosine or linear decay from lr to "
        "lr·lr_final.")
    lr_final: float = _h(0.1, "Final learning rate as a fraction of optim.lr (cosine / linear schedules).", ge=0, le=1)
    lr_decay_iterations: int = _h(0, "Most iterations the cosine / linear decay may take (0 = no cap): it runs over "
        "min(run.iterations, this), then the rate stays at lr·lr_final. A recipe's schedule then keeps its length "
        "when run.iterations and run.budget_minutes let a run go on longer (the 60-minute stability run, "
        "README).", ge=0)
    warmup_iters: int = _h(0, "Linear warm-up of the learning rate over the first N iterations (0 = none).", ge=0)
    inner_epochs: int = _h(1, "Passes over each rollout batch (PPO epochs).", ge=1)
    updates_per_epoch: int = _h(1, "Optimizer steps per pass (the batch is split into this many gradient-accumulation "
        "chunks).", ge=1)
    loss_mean: Literal["planned", "nonzero"] = _h("planned", "What an optimizer step's loss is averaged over when "
        "zero-advantage pairs are skipped (an objective without a KL term, e.g. grpo with kl_beta 0): planned = every "
        "planned (sample, step) pair, the skipped ones counting as the zeros they are, so skipping only saves compute "
        "and the step size stays put as groups collapse (ADAE's regime); nonzero = only the pairs with A ≠ 0, as "
        "flow_grpo's train_sd3.py (it filters zero-advantage samples, then averages what is left), so the step grows "
        "by N_planned / N_nonzero (docs/ALGORITHMS.md §9.4).")
    micro_batch: int = _h(64, "(sample, step) pairs per forward/backward; only changes memory, not the "
        "gradient.", ge=1)
    ema_decay: float = _h(0.0, "EMA of trainable weights (0 = off); evaluation uses the EMA weights when "
        "on.", ge=0, lt=1)
    offload_optimizer: bool = _h(False, "Keep AdamW's moments (and an fp32 master copy) in CPU memory and step there: "
        "the accelerator keeps only weights + grads (fp32: 8 of 16 bytes/param; docs/SCALING.md).")
    offload_reference: bool = _h(False, "Keep the frozen KL reference copy (kl_beta > 0, non-LoRA) in CPU memory; it "
        "visits the device once per update for one no-grad pass (docs/SCALING.md).")

    def __post_init__(self):
        if self.betas is None:
            self.betas = [0.9, 0.999]
        if len(self.betas) != 2:
            raise ValueError(f"optim.betas must have 2 values, got {self.betas}")
        if self.kl_reference == "ema" and self.kl_beta == 0:
            raise ValueError(
                "optim.kl_reference=ema moves the KL reference, but optim.kl_beta=0 has no KL term; set optim.kl_beta "
                "> 0 or leave optim.kl_reference=initial"
            )
        if self.kl_base_beta > 0 and self.kl_reference != "ema":
            raise ValueError(
                f"optim.kl_base_beta={self.kl_base_beta} adds a KL to the initial weights next to an EMA reference, "
                "but optim.kl_reference=initial is the initial weights already; add it to optim.kl_beta or set "
                "optim.kl_reference=ema"
            )
        if self.kl_reference_decay_rate > 0 and self.kl_reference != "ema":
            raise ValueError(
                f"optim.kl_reference_decay_rate={self.kl_reference_decay_rate} ramps the EMA reference's decay, but "
                f"optim.kl_reference={self.kl_reference}; set optim.kl_reference=ema or kl_reference_decay_rate=0"
            )


@dataclass
class TrainConfig:
    method: Literal["flow_grpo", "stepwise", "vgpo", "custom"] = _h("flow_grpo", "Shorthand for credit.name "
        "(flowcredit train method=X also picks the preset tiny_X); an explicit credit.name wins and this follows it "
        "(custom for a plugin's method). Not written to config.yaml.", sets="credit.name", unless=("custom",))
    model: ModelCfg = _h(ModelCfg, "The policy model (tiny built-in, SD3, FLUX) and what is trained.")
    sampler: SamplerCfg = _h(SamplerCfg, "Rollout SDE, time grid and which steps are trained.")
    data: DataCfg = _h(DataCfg, "Training prompts and group layout.")
    reward: RewardCfg = _h(RewardCfg, "The reward (or weighted mix of rewards).")
    credit: CreditCfg = _h(CreditCfg, "Credit assignment: the advantage estimator {name, options} and the knobs they "
        "share.")
    objective: ObjectiveCfg = _h(ObjectiveCfg, "The loss the advantages train: grpo, nft or awm.")
    estimate: EstimateCfg = _h(EstimateCfg, "Intermediate x̂0 estimates for step-level rewards (Stepwise, VGPO).")
    optim: OptimCfg = _h(OptimCfg, "Optimizer, PPO clip, KL and update schedule.")
    run: RunCfg = _h(RunCfg, "Run folder, budget, logging, checkpoints and evaluation.")
    dist: DistCfg = _h(DistCfg, "Many processes through accelerate (docs/SCALING.md).")
    faults: FaultsCfg = _h(FaultsCfg, "What the run survives: NaN/Inf, failing rewards, signals.")

    def __post_init__(self):
        # The method picks the credit estimator unless the user composes one by hand (method=custom). A loaded config
        # already has credit.name == method (the loader makes the shorthand follow an explicit credit.name); this
        # keeps configs built in code, e.g. TrainConfig(method="vgpo"), consistent too.
        if self.method != "custom":
            self.credit.name = self.method
        self.dist.check(self.model, self.optim)
        if self.sampler.name == "ode" and self.objective.name == "grpo":
            raise ValueError(
                "sampler.name=ode has no exploration noise, so objective.name=grpo cannot train a step; use flow_sde, "
                "ddim_sde or cps, or a forward-process objective (objective.name=nft|awm)"
            )
        if self.sampler.name == "ode" and self.sampler.shared_noise:
            raise ValueError(
                "sampler.shared_noise=true with sampler.name=ode makes every sample of a group identical (the ODE is "
                "deterministic), so group advantages are 0; set sampler.shared_noise=false or use an SDE sampler"
            )
        if self.sampler.train_step_draw == "nft" and self.objective.name == "grpo":
            raise ValueError(
                "sampler.train_step_draw=nft trains the forward process at every grid time (DiffusionNFT); "
                "objective.name=grpo trains SDE steps, use train_step_draw=random|systematic or objective.name=nft|awm"
            )
        if self.sampler.train_step_draw == "awm" and self.objective.name == "grpo":
            raise ValueError(
                "sampler.train_step_draw=awm draws forward-process grid times (AWM's discrete_wo_init); "
                "objective.name=grpo trains SDE steps, use train_step_draw=random|systematic or objective.name=nft|awm"
            )
        if self.optim.kl_base_beta > 0 and self.objective.name not in ("nft", "awm"):
            raise ValueError(
                f"optim.kl_base_beta={self.optim.kl_base_beta} (a second KL to the initial weights) is implemented "
                f"for objective.name=nft|awm (velocity space), not {self.objective.name!r}; set optim.kl_base_beta=0"
            )
        if self.objective.name != "grpo" and self.optim.offload_reference:
            raise ValueError(
                f"optim.offload_reference is implemented for objective.name=grpo only (got {self.objective.name!r}); "
                "set optim.offload_reference=false"
            )

    @property
    def shared_noise(self) -> bool:
        if self.sampler.shared_noise is not None:
            return self.sampler.shared_noise
        # an ODE rollout from a shared x_T gives G identical samples: never shared by default
        return self.method in ("stepwise", "vgpo") and self.sampler.name != "ode"
