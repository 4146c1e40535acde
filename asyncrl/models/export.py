"""Writing weights out: the one place that knows how a model directory is laid out.

Checkpoints (`policy/`), disk weight syncs and the SFT warm start all write HF directories that
transformers 4.x/5.x, `asyncrl serve` and vLLM load as they are; the HTTP bucket push and these
files skip tied aliases the same way (`without_tied_aliases`).
"""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch


def without_tied_aliases(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor once: tied weights (lm_head = embed_tokens) are one tensor under two names,
    which safetensors refuses to store twice; HF checkpoints of tied models hold the first name
    only, and loaders re-tie from the config."""
    seen: set[tuple[int, tuple[int, ...]]] = set()
    for name, tensor in named_tensors:
        key = (tensor.data_ptr(), tuple(tensor.shape))
        if tensor.numel() and key in seen:
            continue
        seen.add(key)
        yield name, tensor


def _both_config_spellings(out: Path) -> None:
    """transformers 5 writes "dtype" and a nested "rope_parameters"; readers on 4.x (as pinned
    by many vLLM releases) look for "torch_dtype" and a top-level "rope_theta": write both."""
    config_file = out / "config.json"
    config = json.loads(config_file.read_text())
    config.setdefault("torch_dtype", config.get("dtype"))
    rope = config.get("rope_parameters") or {}
    if "rope_theta" in rope:
        config.setdefault("rope_theta", rope["rope_theta"])
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def save_model_dir(model: Any, tokenizer: Any, out_dir: str | Path) -> Path:
    """A model object + tokenizer as a HF directory (save_pretrained: generation_config too)."""
    from asyncrl.models.hf_quiet import quiet_hf_progress
    from asyncrl.models.tokenizer import save_tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with quiet_hf_progress():
        model.save_pretrained(out, safe_serialization=True)
    _both_config_spellings(out)
    save_tokenizer(tokenizer, out)
    return out


def save_weights_dir(weights: Mapping[str, torch.Tensor], hf_config: Any, out_dir: str | Path,
                     tokenizer: Any = None, untie: bool = False) -> Path:
    """A HF directory from full weights (e.g. gathered from FSDP shards): config.json,
    model.safetensors (tied tensors stored once), and the tokenizer when given.

    `untie`: a tied model is written with an output head of its own (a copy of the embeddings,
    config tie_word_embeddings=false), for servers that do not re-tie on a reload (vLLM)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().to("cpu").contiguous()
               for name, t in without_tied_aliases(weights.items())}
    if untie and getattr(hf_config, "tie_word_embeddings", False):
        hf_config = copy.deepcopy(hf_config)
        hf_config.tie_word_embeddings = False
        tensors["lm_head.weight"] = tensors[_embedding_name(tensors)].clone()
    hf_config.save_pretrained(out)
    _both_config_spellings(out)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer is not None:  # loadable by transformers 4.x and 5.x alike, as the class it is
        from asyncrl.models.tokenizer import save_tokenizer

        save_tokenizer(tokenizer, out)
    return out


def _embedding_name(tensors: Mapping[str, torch.Tensor]) -> str:
    names = [n for n in tensors if n.endswith("embed_tokens.weight")]
    if len(names) != 1:
        raise ValueError(f"cannot untie the output head: expected one '*embed_tokens.weight' "
                         f"tensor, found {names}")
    return names[0]


def untied_copy(model_dir: str | Path, out_dir: str | Path) -> Path:
    """`model_dir` as it is when its config does not tie the output head to the embeddings;
    otherwise a copy under `out_dir` with an untied head (see `save_weights_dir`)."""
    import transformers
    from safetensors.torch import load_file

    src = Path(model_dir)
    config = transformers.AutoConfig.from_pretrained(src, local_files_only=True)
    if not getattr(config, "tie_word_embeddings", False):
        return src
    state: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        state.update(load_file(str(f)))
    out = Path(out_dir)
    if out.exists():
        shutil.rmtree(out)
    for f in src.iterdir():  # tokenizer and generation config travel unchanged
        if f.is_file() and not f.name.endswith(".safetensors") and f.name not in (
                "config.json", "model.safetensors.index.json"):
            out.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, out / f.name)
    return save_weights_dir(state, config, out, untie=True)
