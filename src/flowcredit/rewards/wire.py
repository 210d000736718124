"""The reward service's wire format (JSON, schema "flowcredit.reward.v1"): typed, language-neutral, never pickle.

Request (POST /score, Content-Type: application/json):

    {"schema": "flowcredit.reward.v1",                      # optional; if present it must match
     "images": {"encoding": "png", "data": ["<base64 PNG>", ...]}
             | {"encoding": "safetensors", "data": "<base64 safetensors file>"},
     "prompts": ["...", ...],                               # B strings
     "metadata": [{...}, ...]}                              # optional, B JSON objects (default {})

PNG images are 8-bit RGB (RGBA/L are converted), all of the same size; they decode to float (B, 3, H, W) = uint8/255.
The safetensors file holds one tensor "images": uint8 (B, H, W, 3), or float32/float16 (B, 3, H, W) in [0, 1]; a
float32 tensor round-trips bit-exactly. safetensors is a header + raw bytes format: loading it executes nothing.

Response 200:

    {"schema": ..., "reward": "<name>", "scores": [B floats], "components": {"<name>": [B floats]},
     "info": {JSON-able extras}, "elapsed_s": float}

Errors: {"error": "<reason>", "status": <code>}, the reason on one line, with 400 (not JSON, pickle, bad base64),
401 (token), 404, 405, 411 (no Content-Length), 413 (body or image too large), 415 (not JSON content type), 422
(schema; or the reward cannot score this input: it raised ValueError, e.g. "reward 'shapes' cannot score this input:
shapes world resolution 20 is not supported; use one of [32, 64]"), 500 (the reward failed otherwise), 503
(shutting down). A client should treat 4xx (but 408/429) as an error in its input, raised at once, and 5xx as a
server fault it may retry on another server.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .base import RewardOutput, to_uint8_hwc

SCHEMA = "flowcredit.reward.v1"
ENCODINGS = ("png", "safetensors")


class WireError(ValueError):
    """A request or response that does not follow the schema; `status` is the HTTP code to answer with."""

    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status, self.reason = status, reason


def looks_like_pickle(body: bytes) -> bool:
    """Pickle protocol 2+ starts with PROTO (0x80) and the protocol number."""
    return len(body) >= 2 and body[0] == 0x80 and 2 <= body[1] <= 5


# ------------------------------------------------------------------------------------------------- encode
def encode_images(images: Tensor, encoding: str = "png") -> dict[str, Any]:
    if encoding == "png":
        from PIL import Image

        out = []
        for a in to_uint8_hwc(images).numpy():
            buf = io.BytesIO()
            Image.fromarray(a).save(buf, format="PNG", compress_level=1)
            out.append(base64.b64encode(buf.getvalue()).decode("ascii"))
        return {"encoding": "png", "data": out}
    if encoding == "safetensors":
        from safetensors.torch import save

        t = images.detach().to("cpu", torch.float32).contiguous()
        return {"encoding": "safetensors", "data": base64.b64encode(save({"images": t})).decode("ascii")}
    raise ValueError(f"image encoding must be one of {ENCODINGS}, got {encoding!r}")


def encode_request(images: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]] | None,
                   encoding: str = "png") -> bytes:
    body: dict[str, Any] = {"schema": SCHEMA, "images": encode_images(images, encoding), "prompts": list(prompts)}
    if metadata is not None:
        body["metadata"] = [dict(m) for m in metadata]
    return json.dumps(body).encode()


# ------------------------------------------------------------------------------------------------- decode
def _b64(s: Any, what: str) -> bytes:
    if not isinstance(s, str):
        raise WireError(422, f"{what} must be a base64 string")
    try:
        return base64.b64decode(s, validate=True)
    except (binascii.Error, ValueError):
        raise WireError(400, f"{what} is not valid base64") from None


def _decode_png(data: Any, max_pixels: int) -> Tensor:
    from PIL import Image, UnidentifiedImageError

    if not isinstance(data, list) or not data:
        raise WireError(422, "images.data must be a non-empty list of base64 PNG strings for encoding 'png'")
    arrs = []
    for i, s in enumerate(data):
        raw = _b64(s, f"images.data[{i}]")
        if not raw.startswith(b"\x89PNG\r\n\x1a\n"):
            raise WireError(422, f"images.data[{i}] is not a PNG (only PNG is accepted for encoding 'png')")
        try:
            im = Image.open(io.BytesIO(raw))
            w, h = im.size
            if w * h > max_pixels:
                raise WireError(413, f"images.data[{i}] is {w}x{h}, more than max_pixels={max_pixels}")
            im.load()
        except WireError:
            raise
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
            raise WireError(422, f"images.data[{i}] is not a readable PNG: {e}") from None
        arrs.append(np.asarray(im.convert("RGB")))
    if len({a.shape for a in arrs}) != 1:
        raise WireError(422, f"all images must have the same size, got {sorted({a.shape[:2] for a in arrs})}")
    return torch.from_numpy(np.stack(arrs)).permute(0, 3, 1, 2).float() / 255.0


def _decode_safetensors(data: Any, max_pixels: int) -> Tensor:
    from safetensors.torch import load

    raw = _b64(data, "images.data")
    try:
        tensors = load(raw)
    except Exception as e:  # noqa: BLE001  (safetensors raises its own error types for malformed headers)
        raise WireError(422, f"images.data is not a valid safetensors file: {e}") from None
    if set(tensors) != {"images"}:
        raise WireError(422, f"the safetensors file must hold exactly one tensor 'images', got {sorted(tensors)}")
    t = tensors["images"]
    if t.dtype == torch.uint8:
        if t.ndim != 4 or t.shape[-1] != 3:
            raise WireError(422, f"uint8 images must be (B, H, W, 3), got {tuple(t.shape)}")
        t = t.permute(0, 3, 1, 2).float() / 255.0
    elif t.dtype in (torch.float32, torch.float16, torch.bfloat16):
        if t.ndim != 4 or t.shape[1] != 3:
            raise WireError(422, f"float images must be (B, 3, H, W), got {tuple(t.shape)}")
        t = t.float()
        if not torch.isfinite(t).all() or t.min() < 0 or t.max() > 1:
            raise WireError(422, "float images must be finite and in [0, 1]")
    else:
        raise WireError(422, f"images dtype must be uint8, float32, float16 or bfloat16, got {t.dtype}")
    if t.shape[-1] * t.shape[-2] > max_pixels:
        raise WireError(413, f"images are {t.shape[-1]}x{t.shape[-2]}, more than max_pixels={max_pixels}")
    return t


def decode_request(
    body: bytes, max_pixels: int = 4096 * 4096, max_batch: int = 4096
) -> tuple[Tensor, list[str], list[dict[str, Any]]]:
    """Validate and decode a /score body → (images (B,3,H,W) float, prompts, metadata). Raises WireError."""
    if looks_like_pickle(body):
        raise WireError(400, "pickle payloads are refused: send JSON (schema flowcredit.reward.v1, see GET /schema)")
    try:
        req = json.loads(body)
    except (UnicodeDecodeError, ValueError) as e:
        raise WireError(400, f"body is not JSON ({e}); see GET /schema") from None
    if not isinstance(req, dict):
        raise WireError(422, "body must be a JSON object")
    extra = set(req) - {"schema", "images", "prompts", "metadata"}
    if extra:
        raise WireError(422, f"unknown keys {sorted(extra)}; allowed: schema, images, prompts, metadata")
    if "schema" in req and req["schema"] != SCHEMA:
        raise WireError(422, f"schema must be {SCHEMA!r}, got {req['schema']!r}")
    imgs = req.get("images")
    if not isinstance(imgs, dict) or set(imgs) != {"encoding", "data"}:
        raise WireError(422, "images must be an object {encoding, data}")
    enc = imgs["encoding"]
    if enc == "png":
        if isinstance(imgs["data"], list) and len(imgs["data"]) > max_batch:
            raise WireError(413, f"{len(imgs['data'])} images, more than max_batch={max_batch}")
        images = _decode_png(imgs["data"], max_pixels)
    elif enc == "safetensors":
        images = _decode_safetensors(imgs["data"], max_pixels)
    else:
        raise WireError(422, f"images.encoding must be one of {list(ENCODINGS)}, got {enc!r}")
    b = images.shape[0]
    if b > max_batch:
        raise WireError(413, f"{b} images, more than max_batch={max_batch}")
    prompts = req.get("prompts")
    if not isinstance(prompts, list) or len(prompts) != b or not all(isinstance(p, str) for p in prompts):
        raise WireError(422, f"prompts must be a list of {b} strings (one per image)")
    meta = req.get("metadata", [{} for _ in range(b)])
    if not isinstance(meta, list) or len(meta) != b or not all(isinstance(m, dict) for m in meta):
        raise WireError(422, f"metadata must be a list of {b} JSON objects (one per image)")
    return images, prompts, meta


def _jsonable(x: Any, depth: int = 0) -> Any:
    """A JSON-able copy of `x` (tensors/arrays → lists, unknown objects → str), or a marker if not representable."""
    if depth > 6:
        return "<nested too deep>"
    if isinstance(x, np.generic):
        x = x.item()
    if x is None or isinstance(x, (bool, int, str)):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, (Tensor, np.ndarray)):
        return _jsonable(x.tolist(), depth + 1)
    if isinstance(x, (list, tuple)):
        return [_jsonable(v, depth + 1) for v in x]
    if isinstance(x, dict):
        return {str(k): _jsonable(v, depth + 1) for k, v in x.items()}
    if hasattr(x, "__dataclass_fields__"):
        from dataclasses import asdict

        try:
            return _jsonable(asdict(x), depth + 1)
        except Exception:  # noqa: BLE001  (asdict deep-copies every field, which may raise anything: use str)
            pass
    return str(x)


def encode_response(name: str, out: RewardOutput, elapsed: float) -> bytes:
    return json.dumps(
        {
            "schema": SCHEMA,
            "reward": name,
            "scores": [float(v) for v in out.scores.tolist()],
            "components": {k: [float(x) for x in v.tolist()] for k, v in out.components.items()},
            "info": _jsonable(out.info),
            "elapsed_s": elapsed,
        }
    ).encode()


def decode_response(body: bytes, batch: int) -> RewardOutput:
    try:
        r = json.loads(body)
        scores = torch.tensor(r["scores"], dtype=torch.float32)
        comps = {k: torch.tensor(v, dtype=torch.float32) for k, v in r.get("components", {}).items()}
    except (ValueError, KeyError, TypeError) as e:
        raise WireError(502, f"malformed reward-service response: {e}") from None
    if scores.shape != (batch,) or any(v.shape != (batch,) for v in comps.values()):
        raise WireError(502, f"reward service returned {tuple(scores.shape)} scores for a batch of {batch}")
    info = r.get("info", {}) if isinstance(r.get("info"), dict) else {}
    return RewardOutput(scores, comps, info)
