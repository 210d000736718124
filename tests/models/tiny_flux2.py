"""Tiny FLUX.2 pipelines built from config, offline, saved as local diffusers folders (test fixtures).

Two layouts, both from `diffusers.pipelines.flux2`:

  * "flux2":       Flux2Pipeline (FLUX.2 [dev]): Flux2Transformer2DModel WITH the guidance embedding (guidance-
                   distilled), a Mistral3ForConditionalGeneration text encoder behind a PixtralProcessor;
  * "flux2_klein": Flux2KleinPipeline (FLUX.2 [klein] base, `is_distilled=False`): no guidance embedding, true CFG,
                   a Qwen3ForCausalLM text encoder with a Qwen2 tokenizer.

Both share the AutoencoderKLFlux2 (with non-trivial batch-norm statistics, which the pipelines apply to the latents)
and FLUX.1-dev's dynamic-shift scheduler config (what diffusers' scripts/convert_flux2_to_diffusers.py writes).

Nothing is downloaded: the tokenizers are byte-level BPEs trained in memory (`tokenizers`) on the system message and a
few words, with hand-written chat templates of the real formats (Mistral's [SYSTEM_PROMPT]/[INST] markers; Qwen3's
<|im_start|> turns with the empty <think> block of `enable_thinking=False`). The text encoders have the real
encoders' depth where it matters: the pipelines stack hidden states (10, 20, 30) (Mistral) and (9, 18, 27) (Qwen3),
so the tiny encoders have 30 and 27 layers (width 16: cheap, and prompts are encoded once per test process).

Sizes (CPU test speed): 16×16 images, a one-block VAE (no downsampling, 4 latent channels → 16 patchified channels),
a transformer of width 32 with one double and one single block, packed latents (64, 16).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

KINDS = ("flux2", "flux2_klein")
RESOLUTION = 16
MAX_SEQ = {"flux2": 48, "flux2_klein": 32}  # tokenizer model_max_length = the adapters' default text length
TEXT_WIDTH = 16  # text encoder hidden size; the transformer's joint_attention_dim is 3× (three stacked layers)
CORPUS_WORDS = "a red blue green cat dog photo of shape square circle triangle 0 1 2 3"

MISTRAL_SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
                    "[IMG]", "[IMG_BREAK]", "[IMG_END]"]
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]

# Mistral-Small-3.x's chat format (system prompt, then [INST] user turns); message contents are lists of
# {"type": "text", "text": ...} parts (diffusers' format_input) or plain strings.
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['content'] is string %}{% set text = m['content'] %}"
    "{% else %}{% set text = m['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text')"
    " | join('') %}"
    "{% endif %}"
    "{% if m['role'] == 'system' %}[SYSTEM_PROMPT]{{ text }}[/SYSTEM_PROMPT]"
    "{% elif m['role'] == 'user' %}[INST]{{ text }}[/INST]"
    "{% else %}{{ text }}{{ eos_token }}{% endif %}{% endfor %}"
)
# Qwen3's chat format with the empty thinking block Flux2KleinPipeline asks for (enable_thinking=False).
QWEN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def _bpe(specials: list[str], corpus: list[str], vocab_size: int = 400):
    """A byte-level BPE (every byte is in the alphabet, so any text encodes) trained in memory on `corpus`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    return tok


def mistral_processor():
    """A PixtralProcessor (the FLUX.2 [dev] `tokenizer` component) over an in-memory BPE with Mistral's specials."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from transformers import PixtralImageProcessor, PixtralProcessor, PreTrainedTokenizerFast

    bpe = _bpe(MISTRAL_SPECIALS, [SYSTEM_MESSAGE] * 4 + CORPUS_WORDS.split())
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                  pad_token="<pad>", model_max_length=MAX_SEQ["flux2"])
    image_processor = PixtralImageProcessor(patch_size=4, size={"longest_edge": 16})
    return PixtralProcessor(image_processor=image_processor, tokenizer=tok, patch_size=4, spatial_merge_size=1,
                            chat_template=MISTRAL_TEMPLATE)


def qwen_tokenizer():
    """A Qwen2 tokenizer (FLUX.2 [klein]'s) over an in-memory BPE with Qwen's specials and chat template."""
    from transformers import Qwen2TokenizerFast

    bpe = _bpe(QWEN_SPECIALS, ["user assistant"] * 4 + CORPUS_WORDS.split())
    tok = Qwen2TokenizerFast(tokenizer_object=bpe, unk_token=None, bos_token=None, eos_token="<|im_end|>",
                             pad_token="<|endoftext|>", model_max_length=MAX_SEQ["flux2_klein"])
    tok.chat_template = QWEN_TEMPLATE
    return tok


def _mistral3(tok):
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, MistralConfig, PixtralVisionConfig

    text = MistralConfig(hidden_size=TEXT_WIDTH, intermediate_size=32, num_hidden_layers=30, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=8, vocab_size=len(tok), max_position_embeddings=256,
                         sliding_window=None, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, tie_word_embeddings=False)
    vision = PixtralVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 head_dim=8, patch_size=4, image_size=16)
    cfg = Mistral3Config(text_config=text, vision_config=vision, image_token_index=tok.convert_tokens_to_ids("[IMG]"),
                         spatial_merge_size=1, tie_word_embeddings=False)
    return Mistral3ForConditionalGeneration(cfg)


def _qwen3(tok):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(
        hidden_size=TEXT_WIDTH, intermediate_size=32, num_hidden_layers=27, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, vocab_size=len(tok), max_position_embeddings=256,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=True,
    ))


def _transformer(guidance_embeds: bool):
    from diffusers import Flux2Transformer2DModel

    net = Flux2Transformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=3 * TEXT_WIDTH, timestep_guidance_channels=32, mlp_ratio=3.0, axes_dims_rope=(4, 4, 4, 4),
        guidance_embeds=guidance_embeds,
    )
    # random small weights everywhere the real models are not zero, and an output layer large enough that the
    # velocities (and every parity test) are far from trivial
    with torch.no_grad():
        for p in net.proj_out.parameters():
            p.normal_(0.0, 0.2)
    return net


def _vae():
    from diffusers import AutoencoderKLFlux2

    vae = AutoencoderKLFlux2(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",), up_block_types=("UpDecoderBlock2D",),
        block_out_channels=(4,), layers_per_block=1, latent_channels=4, norm_num_groups=1, sample_size=RESOLUTION,
        use_quant_conv=False, use_post_quant_conv=False, mid_block_add_attention=False,
    )
    with torch.no_grad():  # the pipelines de-normalise latents with these statistics before decoding
        vae.bn.running_mean.normal_(0.0, 0.3)
        vae.bn.running_var.uniform_(0.5, 2.0)
    return vae


def _scheduler():
    """FLUX.1-dev's scheduler config (what diffusers' FLUX.2 conversion script saves): dynamic exponential shift."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
        max_image_seq_len=4096,
    )


def build_pipeline(kind: str, seed: int = 0):
    """The tiny `kind` ("flux2" | "flux2_klein") pipeline of random components, all in eval mode."""
    from diffusers import Flux2KleinPipeline, Flux2Pipeline

    torch.manual_seed(seed)
    if kind == "flux2":
        proc = mistral_processor()
        te = _mistral3(proc.tokenizer)
        net, tok = _transformer(guidance_embeds=True), proc
    elif kind == "flux2_klein":
        tok = qwen_tokenizer()
        te = _qwen3(tok)
        net = _transformer(guidance_embeds=False)
    else:
        raise ValueError(f"kind {kind!r}; valid: {KINDS}")
    vae = _vae()
    for m in (net, te, vae):
        m.eval()
    if kind == "flux2":
        pipe = Flux2Pipeline(scheduler=_scheduler(), vae=vae, text_encoder=te, tokenizer=tok, transformer=net)
    else:
        pipe = Flux2KleinPipeline(scheduler=_scheduler(), vae=vae, text_encoder=te, tokenizer=tok, transformer=net,
                                  is_distilled=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def save_tiny(kind: str, directory: str | Path, seed: int = 0) -> Path:
    d = Path(directory)
    build_pipeline(kind, seed).save_pretrained(str(d))
    return d


def load_pipeline(kind: str, directory: str | Path):
    """Load a saved tiny folder with the stock diffusers pipeline class (what a user deploys)."""
    from diffusers import Flux2KleinPipeline, Flux2Pipeline

    cls = Flux2Pipeline if kind == "flux2" else Flux2KleinPipeline
    pipe = cls.from_pretrained(str(directory), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def quiet() -> None:
    import diffusers
    import transformers

    diffusers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


_DIRS: dict[str, Path] = {}


def tiny_model_dir(kind: str) -> Path:
    """The tiny `kind` folder, built once per test process in a temporary directory (removed at exit)."""
    if kind not in _DIRS:
        quiet()
        root = Path(tempfile.mkdtemp(prefix=f"flowcredit-tiny-{kind}-"))
        atexit.register(shutil.rmtree, root, True)
        _DIRS[kind] = save_tiny(kind, root / kind)
    return _DIRS[kind]


def load_adapter(kind: str, precision: str = "fp32", trainable: str = "all", **kw):
    """flowcredit's adapter for the tiny `kind` folder (fp32 by default: parity tests compare to the last bit).

    `kw`: lora_rank (4), lora_alpha (8), gradient_checkpointing (False); the rest go to `from_pretrained`."""
    from flowcredit.config.schema import ModelCfg
    from flowcredit.models.flux2 import Flux2FlowModel

    cfg = ModelCfg(name="flux2", precision=precision, trainable=trainable, lora_rank=kw.pop("lora_rank", 4),
                   lora_alpha=kw.pop("lora_alpha", 8.0),
                   gradient_checkpointing=kw.pop("gradient_checkpointing", False))
    model = Flux2FlowModel.from_pretrained(tiny_model_dir(kind), cfg, resolution=RESOLUTION, **kw)
    if trainable:
        model.configure_trainable(trainable)
    return model


def train_config(kind: str, out_dir: str | Path, *overrides: str):
    """A TrainConfig training the tiny `kind` model with LoRA (r4, α8): 1 prompt × G=2, T=3, CPU, fp32.

    The default objective is grpo (Flow-GRPO on flow_sde rollouts); pass "objective.name=nft", "sampler.name=ode"
    for DiffusionNFT."""
    from flowcredit.config.load import load_config
    from flowcredit.config.schema import TrainConfig

    args = [
        "method=flow_grpo", "model.name=flux2", f"model.path={tiny_model_dir(kind)}", "model.precision=fp32",
        "model.trainable=lora", "model.lora_rank=4", "model.lora_alpha=8", "sampler.num_steps=3",
        f"sampler.guidance_scale={1.0 if kind == 'flux2' else 3.0}", "data.prompts_per_iter=1", "data.group_size=2",
        "reward.name=tiny_diffusers:BrightnessReward", "run.eval_at_end=false", "run.iterations=2", "run.grid_every=0",
        "run.checkpoint_every=100", "optim.kl_beta=0.04", "optim.lr=1e-2", "run.threads=1",
        f"model.options.resolution={RESOLUTION}", f"run.out_dir={out_dir}", *overrides,
    ]
    return load_config(TrainConfig, None, args)
