"""Multimodal prompts: chat messages with images -> what a Qwen2-VL-style model takes.

A message's content may hold image parts: `{"type": "image", "image": X}` or OpenAI's
`{"type": "image_url", "image_url": {"url": X}}`, where X is a PIL image, a file path, raw bytes,
a `data:image/...;base64,` URL or a `datasets` Image value (`{"bytes": ..., "path": ...}`); an
image part without a payload (`{"type": "image"}`) takes the next of `images`, in order. The chat
template renders each image as the model's placeholder (<|vision_start|><|image_pad|>
<|vision_end|>); `encode` then repeats <|image_pad|> once per merged patch block of that image
(grid t * h * w / merge_size^2), which is what Qwen2-VL's processor does and what vLLM puts in a
served prompt, and returns the image processor's pixel patches and grid sizes beside the ids.

transformers' combined processor is not used: it also wants a video processor, which needs
torchvision (absent where torch is a CPU build); the image processor and the tokenizer load alone.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import inspect
import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image, UnidentifiedImageError

from asyncrl.api.images import ImageInputs
from asyncrl.models.chat import encode_chat_prompt, render_chat

IMAGE_PAD = "<|image_pad|>"
# The tokens a Qwen2-VL-style model locates images by (vlm_forward_kwargs reads a generated one as 0)
VISION_TOKENS = (IMAGE_PAD, "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")


@dataclass(frozen=True)
class ImagePrompt:
    input_ids: list[int]  # the placeholder expanded: one IMAGE_PAD id per merged patch block
    pixel_values: torch.Tensor  # [patches of every image, channels * temporal * patch^2]
    image_grid_thw: torch.Tensor  # [images, 3]: each image's (t, h, w) in patches
    pad_id: int | None = None  # the IMAGE_PAD id
    vision_ids: tuple[int, ...] = ()  # every vision token id (VISION_TOKENS)
    pictures: tuple[Image.Image, ...] = ()  # the images, as the processor was given them

    @property
    def num_images(self) -> int:
        return int(self.image_grid_thw.shape[0])

    def image_inputs(self) -> ImageInputs | None:
        """What a `Sample` of this prompt carries (None without images)."""
        return image_inputs(self.pixel_values, self.image_grid_thw, self.pad_id, self.pictures,
                            self.vision_ids)


def image_inputs(pixel_values: torch.Tensor, grid_thw: torch.Tensor, pad_id: int | None = None,
                 sources: Sequence[Image.Image] = (), vision_ids: Sequence[int] = ()
                 ) -> ImageInputs | None:
    """What a `Sample` carries of these processed images, with their digest (None for none)."""
    if not grid_thw.shape[0]:
        return None
    digest = hashlib.sha256(grid_thw.numpy().tobytes()
                            + pixel_values.numpy().tobytes()).hexdigest()[:16]
    return ImageInputs(pixel_values, grid_thw, digest, pad_id, tuple(vision_ids), tuple(sources))


def image_tokens(grid_thw: torch.Tensor, merge_size: int) -> list[int]:
    """How many <|image_pad|> each image of `grid_thw` [images, 3] takes: one per merged
    merge_size x merge_size patch block."""
    return [int(g.prod()) // merge_size ** 2 for g in grid_thw]


def load_image(value: Any) -> Image.Image:
    """An RGB PIL image from any of the forms the module docstring lists (ValueError otherwise,
    naming the form)."""
    if isinstance(value, Image.Image):
        return value.convert("RGB")
    if isinstance(value, Mapping):  # a `datasets` Image value, or {"url": ...}
        inner = value.get("bytes") or value.get("path") or value.get("url")
        if inner is None:
            raise ValueError(f"image {sorted(value)}: needs 'bytes', 'path' or 'url'")
        return load_image(inner)
    try:
        if isinstance(value, (bytes, bytearray)):
            return Image.open(io.BytesIO(value)).convert("RGB")
        if isinstance(value, str) and value.startswith("data:"):
            header, _, payload = value.partition(",")
            if ";base64" not in header:
                raise ValueError(f"image data URL {header[:40]!r}...: only base64 is supported")
            return load_image(base64.b64decode(payload, validate=True))
        if isinstance(value, (str, Path)):
            with Image.open(value) as img:
                return img.convert("RGB")
    except (OSError, UnidentifiedImageError, binascii.Error) as err:
        raise ValueError(f"image {_describe(value)} cannot be decoded: {err}") from None
    raise ValueError(f"image of type {type(value).__name__}: allowed a PIL image, a path, bytes, "
                     "a base64 data URL or {'bytes'|'path': ...}")


def _describe(value: Any) -> str:
    if isinstance(value, (bytes, bytearray)):
        return f"({len(value)} bytes)"
    return repr(str(value)[:80])


def message_images(messages: Sequence[Mapping[str, Any]], images: Sequence[Any] = ()
                   ) -> list[Image.Image]:
    """The images of `messages`' image parts, in order (a part without a payload takes the next of
    `images`); every one of `images` must be taken."""
    extra, out = list(images), []
    for message in messages:
        content = message.get("content")
        for part in content if isinstance(content, list) else ():
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind == "image_url":
                url = part.get("image_url")
                out.append(load_image(url.get("url") if isinstance(url, Mapping) else url))
            elif kind == "image":
                if part.get("image") is not None:
                    out.append(load_image(part["image"]))
                elif extra:
                    out.append(load_image(extra.pop(0)))
                else:
                    raise ValueError(f"image part {len(out)} has no payload and no image is left "
                                     f"of the {len(images)} given")
    if extra:
        raise ValueError(f"{len(images)} images given but the messages have only "
                         f"{len(images) - len(extra)} image parts without a payload")
    return out


class VisionPromptEncoder:
    """Chat messages with images -> `ImagePrompt`, with a model's tokenizer and image processor
    (`AutoImageProcessor.from_pretrained(model_dir)`)."""

    def __init__(self, tokenizer: Any, image_processor: Any) -> None:
        self.tokenizer, self.image_processor = tokenizer, image_processor
        self.pad_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
        if self.pad_id is None or self.pad_id == tokenizer.unk_token_id:
            raise ValueError(f"the tokenizer has no {IMAGE_PAD} token: not a vision-language "
                             "model's tokenizer")
        self.merge = int(getattr(image_processor, "merge_size", 2))
        ids = (tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS)
        self.vision_ids = tuple(i for i in ids if i is not None and i != tokenizer.unk_token_id)

    @classmethod
    def from_model_dir(cls, path: str | Path, trust_remote_code: bool = False
                       ) -> VisionPromptEncoder:
        """The encoder of the model directory `path` (its tokenizer and image processor)."""
        from transformers import AutoImageProcessor

        from asyncrl.models.loading import check_model_dir, load_tokenizer

        p = check_model_dir(path)
        if not (p / "preprocessor_config.json").is_file():
            raise ValueError(f"model dir {p} has no preprocessor_config.json: not a "
                             "vision-language model (no image processor)")
        processor = AutoImageProcessor.from_pretrained(p, local_files_only=True,
                                                       trust_remote_code=trust_remote_code)
        return cls(load_tokenizer(p, trust_remote_code), processor)

    def encode(self, messages: Sequence[Mapping[str, Any]], images: Sequence[Any] = (),
               template_kwargs: Mapping[str, Any] | None = None) -> ImagePrompt:
        """The prompt of `messages` (generation prompt appended) with its images."""
        pictures = message_images(messages, images)
        text = render_chat(self.tokenizer, list(messages), True, None, template_kwargs)
        if text.count(IMAGE_PAD) != len(pictures):
            raise ValueError(f"the chat template placed {text.count(IMAGE_PAD)} images but the "
                             f"messages hold {len(pictures)}: does it render image parts?")
        pixels, grid = self.process(pictures)
        return ImagePrompt(self.expand(text, self.tokens_per_image(grid)), pixels, grid,
                           self.pad_id, self.vision_ids, tuple(pictures))

    def image_inputs(self, pictures: Sequence[Image.Image]) -> ImageInputs | None:
        """What a request or sample carries of `pictures` (None for none)."""
        pixels, grid = self.process(pictures)
        return image_inputs(pixels, grid, self.pad_id, pictures, self.vision_ids)

    def process(self, pictures: Sequence[Image.Image]) -> tuple[torch.Tensor, torch.Tensor]:
        """(pixel patches, grid sizes [images, 3]) of `pictures` from the image processor."""
        if not pictures:
            return torch.zeros(0, 0), torch.zeros(0, 3, dtype=torch.long)
        processed = self.image_processor(images=list(pictures), return_tensors="pt")
        return processed["pixel_values"], processed["image_grid_thw"]

    def tokens_per_image(self, grid: torch.Tensor) -> list[int]:
        return image_tokens(grid, self.merge)

    def expand(self, text: str, counts: Sequence[int]) -> list[int]:
        """Token ids of rendered `text` whose k image placeholders are the last k images of
        `counts` (tokens per image, in order): each placeholder repeated that many times. A text
        continuing a conversation holds only its newest images, hence the last ones."""
        pieces = text.split(IMAGE_PAD)
        k = len(pieces) - 1
        if k > len(counts):
            raise ValueError(f"the text holds {k} image placeholders but {len(counts)} images "
                             "were given")
        tail = list(counts)[len(counts) - k:]
        expanded = pieces[0] + "".join(IMAGE_PAD * n + rest for n, rest in zip(tail, pieces[1:]))
        return self.tokenizer.encode(expanded, add_special_tokens=False)


def vision_encoder(path: str | Path, trust_remote_code: bool = False
                   ) -> VisionPromptEncoder | None:
    """The prompt encoder of a vision-language model directory; None for a text model."""
    from asyncrl.models.config import is_vision_language

    if not is_vision_language(path):
        return None
    return VisionPromptEncoder.from_model_dir(path, trust_remote_code)


def row_prompt(tokenizer: Any, vision: VisionPromptEncoder | None, row: Mapping[str, Any],
               template_kwargs: Mapping[str, Any] | None = None
               ) -> tuple[list[int], ImageInputs | None]:
    """A data row's prompt ids and images (`row["messages"]`, `row.get("images")`): through
    `vision` for a vision-language model, else as text; a row with images and no `vision` is a
    ValueError (a text-only model would silently drop them)."""
    if vision is None:
        if row.get("images") or message_has_images(row["messages"]):
            raise ValueError(f"row id={row.get('id')!r} has images but the model is text-only")
        return encode_chat_prompt(tokenizer, row["messages"], template_kwargs=template_kwargs), None
    prompt = vision.encode(row["messages"], row.get("images") or (), template_kwargs)
    return prompt.input_ids, prompt.image_inputs()


def message_has_images(messages: Sequence[Mapping[str, Any]]) -> bool:
    return any(isinstance(m.get("content"), list) and any(
        isinstance(p, Mapping) and p.get("type") in ("image", "image_url") for p in m["content"])
        for m in messages)


def vlm_forward_kwargs(model: Any, ids: torch.Tensor, prompt: torch.Tensor,
                       images: Sequence[ImageInputs]) -> dict[str, Any]:
    """The inputs of a Qwen2-VL-style forward over rows `ids` [B, L]; `prompt` [B, L] (bool)
    marks the tokens that were not generated, whose image tokens `images` fill, in order.

    A generated token that happens to be a vision token id (<|image_pad|>, <|video_pad|>,
    <|vision_start|>, <|vision_end|>: a trained VLM rarely samples one, a random one does) is read
    back as id 0: transformers locates placeholders and multimodal positions by these ids and
    would count it ("Image features and image tokens do not match"). The in-process engine and
    the trainer both read it so, so their logprobs agree; vLLM, whose placeholders come from the
    prompt's processing, reads such a token as itself, so the two differ after one."""
    cfg = model.config
    special = torch.tensor([cfg.image_token_id, cfg.video_token_id,
                            cfg.vision_start_token_id, getattr(cfg, "vision_end_token_id", -1)],
                           device=ids.device)
    kwargs: dict[str, Any] = {"input_ids": ids.masked_fill(torch.isin(ids, special) & ~prompt, 0)}
    if images:
        device = ids.device
        kwargs["pixel_values"] = torch.cat([x.pixel_values for x in images]).to(device)
        kwargs["image_grid_thw"] = torch.cat([x.grid_thw for x in images]).to(device)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if "mm_token_type_ids" in inspect.signature(base.forward).parameters:
        # transformers >= 5.2x derives multimodal positions from it (1: an image token)
        kwargs["mm_token_type_ids"] = (prompt & (ids == cfg.image_token_id)).long()
    return kwargs
