"""The image side of a vision-language model in the compact engine (Qwen2-VL, Qwen2.5-VL).

The language model is the compact decoder (`decoder.py`, as Qwen2); this module adds what images need:

- `language_config`: the decoder's HF config fields, read from a VLM config (`text_config` in
  transformers 5, top-level in older exports), with its M-RoPE sections.
- `VisionTower`: transformers' own vision module (patch embedding, blocks, merger), fed the
  weights by their HF names; it runs once per prompt's images and keeps the result by their
  digest, so the samples of a GRPO group (one ImageInputs object) and a prompt re-prefilled after
  a weight update reuse it until the weights change.
- `mrope_positions`: a prompt's multimodal rotary positions (3 streams: time, height, width) and
  its rope delta, as transformers' `get_rope_index` computes them for the trainer: text tokens
  count up in all three streams, an image's merged patch block at (start, start + row,
  start + col), and text after an image resumes at start + max(rows, cols). Decoding then rotates
  each new token at its cache position + the delta, the same in all streams.

A generated vision token (a random model samples them) is read as id 0, as the trainer reads it
(models/vision.vlm_forward_kwargs), in the input ids, the positions and the embeddings alike.
"""

from __future__ import annotations

import importlib
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

# model_type -> transformers' vision module (imported on use)
TOWERS = {
    "qwen2_vl": ("transformers.models.qwen2_vl.modeling_qwen2_vl",
                 "Qwen2VisionTransformerPretrainedModel"),
    "qwen2_5_vl": ("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl",
                   "Qwen2_5_VisionTransformerPretrainedModel"),
    "qwen3_vl": ("transformers.models.qwen3_vl.modeling_qwen3_vl", "Qwen3VLVisionModel"),
}
VLM_ARCHITECTURES = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
                     "Qwen3VLForConditionalGeneration")
# a VLM's decoder as the causal LM the compact decoder reads it as
DECODERS = {"qwen3_vl": ("Qwen3ForCausalLM", "qwen3")}
CACHED_PROMPTS = 32  # vision outputs kept (a few GRPO groups' prompts)


def is_vlm_config(cfg: Mapping[str, Any]) -> bool:
    return any(a in VLM_ARCHITECTURES for a in cfg.get("architectures") or [])


def language_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The decoder's config of a Qwen2-VL-style `cfg`, as a Qwen2ForCausalLM (Qwen3-VL: a
    Qwen3ForCausalLM) config plus `mrope_section` and `mrope_interleaved`; a text model's `cfg`
    as it is."""
    if not is_vlm_config(cfg):
        return dict(cfg)
    out = {k: v for k, v in cfg.items() if k not in ("text_config", "vision_config")}
    out.update(cfg.get("text_config") or {})
    rope = dict(out.get("rope_parameters") or out.get("rope_scaling") or {})
    section = rope.pop("mrope_section", None)
    if rope.get("type") == "mrope" or rope.get("rope_type") == "mrope":
        rope.pop("type", None)
        rope["rope_type"] = "default"  # M-RoPE rotates each section with the default frequencies
    rope.pop("type", None)
    interleaved = bool(rope.pop("mrope_interleaved", False))
    arch, model_type = DECODERS.get(cfg.get("model_type"), ("Qwen2ForCausalLM", "qwen2"))
    out.update(architectures=[arch], model_type=model_type, rope_parameters=rope,
               mrope_section=list(section) if section else None, rope_scaling=None,
               mrope_interleaved=interleaved)
    # a tied head may be declared at the top or in the text config
    out["tie_word_embeddings"] = bool(cfg.get("tie_word_embeddings") or (
        cfg.get("text_config") or {}).get("tie_word_embeddings"))
    return out


def image_token_count(grid_thw: torch.Tensor, merge: int) -> list[int]:
    return [int(g.prod()) // merge ** 2 for g in grid_thw]


def check_image_tokens(input_ids: Sequence[int], images: Any, image_token_id: int,
                       merge: int) -> None:
    """ValueError unless the prompt holds exactly the image tokens its images' grids need."""
    want = 0 if images is None else sum(image_token_count(images.grid_thw, merge))
    got = list(input_ids).count(image_token_id)
    if got != want:
        raise ValueError(f"the prompt has {got} image tokens but its images' grids need {want}: "
                         "encode it with models/vision.py's VisionPromptEncoder (a prompt "
                         "without images must hold no image token)")


def mrope_positions(ids: Sequence[int], image_token_id: int, grids: Sequence[Sequence[int]],
                    merge: int) -> tuple[list[list[int]], int]:
    """([time, height, width] positions of every token, rope delta) of a prompt whose runs of
    `image_token_id` are its images (`grids`: each image's (t, h, w) in patches, in order)."""
    streams: list[list[int]] = [[], [], []]
    images, i, pos, n = iter(grids), 0, 0, len(ids)
    while i < n:
        if ids[i] != image_token_id:
            for s in streams:
                s.append(pos)
            i, pos = i + 1, pos + 1
            continue
        t, h, w = (int(x) for x in next(images))
        h, w = h // merge, w // merge
        if ids[i:i + t * h * w] != [image_token_id] * (t * h * w) or (
                i + t * h * w < n and ids[i + t * h * w] == image_token_id):
            raise ValueError(f"an image run at token {i} does not match its grid {(t, h, w)} "
                             f"(merged): it needs exactly {t * h * w} image tokens")
        for tt in range(t):
            for hh in range(h):
                for ww in range(w):
                    streams[0].append(pos + tt)
                    streams[1].append(pos + hh)
                    streams[2].append(pos + ww)
        i, pos = i + t * h * w, pos + max(h, w)
    return streams, max(max(s) for s in streams) + 1 - n if n else 0


class VisionTower:
    """transformers' vision module of a Qwen2-VL-style checkpoint, run without autograd."""

    def __init__(self, path: str, hf_config: Mapping[str, Any], dtype: torch.dtype,
                 device: torch.device) -> None:
        from transformers import AutoConfig

        from asyncrl.models.hf_quiet import quiet_hf_progress

        model_type = hf_config.get("model_type")
        if model_type not in TOWERS:
            raise ValueError(f"model_type={model_type!r} has no vision tower here; supported "
                             f"{sorted(TOWERS)}")
        module, name = TOWERS[model_type]
        vision_config = AutoConfig.from_pretrained(path, local_files_only=True).vision_config
        with quiet_hf_progress():
            self.module = getattr(importlib.import_module(module), name)._from_config(
                vision_config, dtype=dtype).to(device).eval()
        self.image_token_id = int(hf_config["image_token_id"])
        self.merge = int(vision_config.spatial_merge_size)
        self.vision_ids = torch.tensor(sorted({
            int(hf_config[k]) for k in ("image_token_id", "video_token_id",
                                        "vision_start_token_id", "vision_end_token_id")
            if hf_config.get(k) is not None}))
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()

    def load_weights(self, pairs: Iterable[tuple[str, torch.Tensor]], strict: bool) -> None:
        """Copy vision-module tensors (names inside the module) in place; names and shapes are
        checked first. Forgets every cached output (they came from the old weights)."""
        params = self.module.state_dict()
        staged, seen = [], set()
        for name, tensor in pairs:
            if name not in params:
                raise ValueError(f"unknown vision weight {name!r}")
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise ValueError(f"vision weight {name!r} has shape {tuple(tensor.shape)}; "
                                 f"expected {tuple(params[name].shape)}")
            staged.append((params[name], tensor))
            seen.add(name)
        missing = sorted(set(params) - seen)
        if strict and missing:
            raise ValueError(f"{len(missing)} vision weights missing, e.g. {missing[:3]}")
        with torch.no_grad():
            for target, tensor in staged:
                target.copy_(tensor)
        self._cache.clear()

    @torch.inference_mode()
    def embed(self, prompts: Sequence[Any]) -> list[torch.Tensor]:
        """[image tokens, hidden] of each prompt's images (ImageInputs): from the cache when
        their digest was seen since the last weight update, the rest in one tower call. A
        tower with DeepStack features (Qwen3-VL) gives [1 + deepstack layers, image tokens,
        hidden]: the merged output, then the feature each of the first decoder layers adds."""
        out = {d: self._cache[d] for d in {x.digest for x in prompts} if d in self._cache}
        todo = list({x.digest: x for x in prompts if x.digest not in out}.values())
        if todo:
            device = next(self.module.parameters()).device
            grid = torch.cat([x.grid_thw for x in todo])
            result = self.module(torch.cat([x.pixel_values for x in todo]).to(
                device, self.module.dtype), grid_thw=grid.to(device))
            merged = result.pooler_output if hasattr(result, "pooler_output") else result
            deepstack = getattr(result, "deepstack_features", None)
            if deepstack:
                merged = torch.stack([merged, *deepstack])
            sizes = [sum(image_token_count(x.grid_thw, self.merge)) for x in todo]
            out.update(zip((x.digest for x in todo), merged.split(sizes, dim=-2)))
        for x in prompts:
            self._cache[x.digest] = out[x.digest]
            self._cache.move_to_end(x.digest)
        while len(self._cache) > CACHED_PROMPTS:
            self._cache.popitem(last=False)
        return [out[x.digest] for x in prompts]

    def readable_ids(self, token_ids: Sequence[int], prompt_len: int) -> list[int]:
        """`token_ids` as the trainer reads them: generated vision tokens as id 0."""
        vision = set(self.vision_ids.tolist())
        return list(token_ids[:prompt_len]) + [0 if t in vision else t
                                               for t in token_ids[prompt_len:]]
