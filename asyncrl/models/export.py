"""Writing weights out: the one place that knows how a model directory is laid out.

Checkpoints (`policy/`), disk weight syncs and the SFT warm start all write HF directories with
transformers' own `save_pretrained`: config.json, generation_config.json, safetensors sharded by
`max_shard_size` (model.safetensors, or model-0000N-of-0000M.safetensors + an index), tokenizer
files and chat template, which transformers 4.x/5.x, `asyncrl serve` and vLLM load as they are.
Readers find the weight files of such a directory with `weight_files`. The HTTP bucket push and
these files skip tied aliases the same way (`without_tied_aliases`).
"""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from asyncrl.models.config import DEFAULT_SHARD_SIZE, parse_shard_size

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


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


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files holding a model directory's weights: the shards its index names,
    else model.safetensors, else every *.safetensors (other files there, such as a LoRA
    adapter's adapter_model.safetensors, are not the model's)."""
    p = Path(model_dir)
    index = p / INDEX_FILE
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (p / s).is_file()]
        if missing:
            raise ValueError(f"{index} names shards that are not there: {missing}")
        return [p / s for s in shards]
    if (p / SINGLE_FILE).is_file():
        return [p / SINGLE_FILE]
    return sorted(p.glob("*.safetensors"))


def export_generation_config(base: Any, hf_config: Any, tokenizer: Any = None) -> Any:
    """The generation config a written directory carries: the base model's (`base`, e.g.
    `model.generation_config`), else one derived from `hf_config`; ids it lacks are taken from the
    tokenizer (the built-in engine and vLLM stop at generation_config's eos_token_id)."""
    from transformers import GenerationConfig

    gen = copy.deepcopy(base) if base is not None else GenerationConfig.from_model_config(
        hf_config)
    for field in ("eos_token_id", "pad_token_id", "bos_token_id"):
        if getattr(gen, field, None) is None and tokenizer is not None:
            setattr(gen, field, getattr(tokenizer, field, None))
    return gen


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


def _clear_weights(out: Path) -> None:
    """A directory written over (a disk sync of the same version) must not keep the other
    layout's files: a stale model.safetensors next to a new index is what readers would take."""
    for f in [*out.glob("*.safetensors"), out / INDEX_FILE]:
        f.unlink(missing_ok=True)


# A vision-language model's image processor (and a combined processor's) settings: a policy
# directory written from its weights carries them, so it loads as the base did.
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json",
                   "video_preprocessor_config.json")


def copy_processor_files(src: str | Path | None, out: Path) -> None:
    """The processor files of model directory `src` (those it has) copied into `out`."""
    for name in PROCESSOR_FILES if src is not None else ():
        if (Path(src) / name).is_file():
            shutil.copyfile(Path(src) / name, out / name)


def save_model_dir(model: Any, tokenizer: Any, out_dir: str | Path,
                   max_shard_size: int | str = DEFAULT_SHARD_SIZE,
                   processor_from: str | Path | None = None) -> Path:
    """A model object + tokenizer as a HF directory (save_pretrained: generation_config too);
    `processor_from`: a model directory whose processor files are copied along."""
    from asyncrl.models.hf_quiet import quiet_hf_progress
    from asyncrl.models.tokenizer import save_tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _clear_weights(out)
    if model.can_generate():
        model.generation_config = export_generation_config(model.generation_config,
                                                           model.config, tokenizer)
    with quiet_hf_progress():
        model.save_pretrained(out, max_shard_size=parse_shard_size(max_shard_size),
                              safe_serialization=True)  # 4.x's spelling; 5.x always is safe
    _both_config_spellings(out)
    save_tokenizer(tokenizer, out)
    copy_processor_files(processor_from, out)
    return out


def save_weights_dir(weights: Mapping[str, torch.Tensor], hf_config: Any, out_dir: str | Path,
                     tokenizer: Any = None, untie: bool = False, generation_config: Any = None,
                     max_shard_size: int | str = DEFAULT_SHARD_SIZE,
                     processor_from: str | Path | None = None) -> Path:
    """A HF directory from full weights (e.g. gathered from FSDP shards on rank 0), written by
    `save_pretrained` on a weightless (meta) model of `hf_config`: the weights are written from
    `weights` as they are, one shard at a time (a GPU tensor is copied to the CPU shard by shard),
    with no second copy of the model. `generation_config`: the base model's (see
    `export_generation_config`); the tokenizer is saved when given, and `processor_from`'s
    processor files are copied (`copy_processor_files`).

    `untie`: a tied model is written with an output head of its own (a copy of the embeddings,
    config tie_word_embeddings=false), for servers that do not re-tie on a reload (vLLM)."""
    from asyncrl.models.hf_quiet import quiet_hf_progress

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _clear_weights(out)
    tensors = {name: t.detach() for name, t in without_tied_aliases(weights.items())}
    config = copy.deepcopy(hf_config)  # save_pretrained records dtype and architectures in it
    if untie and ties_head(config):
        config.tie_word_embeddings = False
        config.get_text_config().tie_word_embeddings = False  # a VLM's language model's too
        tensors["lm_head.weight"] = tensors[_embedding_name(tensors)].clone()
    model = _weightless_model(config, tensors)
    _drop_tied_aliases(model, tensors)
    model.generation_config = export_generation_config(generation_config, config, tokenizer)
    with quiet_hf_progress():
        model.save_pretrained(out, state_dict=tensors, safe_serialization=True,
                              max_shard_size=parse_shard_size(max_shard_size))
    _both_config_spellings(out)
    if tokenizer is not None:  # loadable by transformers 4.x and 5.x alike, as the class it is
        from asyncrl.models.tokenizer import save_tokenizer

        save_tokenizer(tokenizer, out)
    copy_processor_files(processor_from, out)
    return out


def policy_model_class(vision_language: bool) -> Any:
    """transformers' auto class a policy loads with: image-text-to-text for a vision-language
    model (it generates text too), else causal LM."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if vision_language else AutoModelForCausalLM


def _weightless_model(config: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """The model class of `config` on the meta device, in the weights' dtype (which
    save_pretrained writes into config.json): its save_pretrained, none of its memory."""
    dtype = next((t.dtype for t in tensors.values() if t.is_floating_point()), torch.float32)
    auto = policy_model_class(getattr(config, "vision_config", None) is not None)
    # A config with an auto_map is one whose code the trainer already runs (it could not have
    # loaded the model otherwise); save_pretrained copies that code next to the weights.
    with torch.device("meta"):
        model = auto.from_config(config, trust_remote_code=bool(getattr(config, "auto_map", None)))
    return model.to(dtype)


def _drop_tied_aliases(model: Any, tensors: dict[str, torch.Tensor]) -> None:
    """Names the model ties to an earlier parameter (lm_head.weight to the embeddings): under
    FSDP the gathered state dict holds them as separate copies, which `without_tied_aliases`
    cannot see; the file holds each weight once either way, and loaders re-tie."""
    first: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first and first[id(param)] in tensors:
            tensors.pop(name, None)
        first.setdefault(id(param), name)


def _embedding_name(tensors: Mapping[str, torch.Tensor]) -> str:
    names = [n for n in tensors if n.endswith("embed_tokens.weight")]
    if len(names) != 1:
        raise ValueError(f"cannot untie the output head: expected one '*embed_tokens.weight' "
                         f"tensor, found {names}")
    return names[0]


def ties_head(config: Any) -> bool:
    """Whether a HF config ties the output head to the embeddings (a vision-language model's
    says so in its text config as well)."""
    return bool(getattr(config, "tie_word_embeddings", False)
                or getattr(config.get_text_config(), "tie_word_embeddings", False))


def untied_copy(model_dir: str | Path, out_dir: str | Path,
                max_shard_size: int | str = DEFAULT_SHARD_SIZE,
                trust_remote_code: bool = False) -> Path:
    """`model_dir` as it is when its config does not tie the output head to the embeddings;
    otherwise a copy under `out_dir` with an untied head (see `save_weights_dir`)."""
    import transformers
    from safetensors.torch import load_file

    src = Path(model_dir)
    config = transformers.AutoConfig.from_pretrained(src, local_files_only=True,
                                                     trust_remote_code=trust_remote_code)
    if not ties_head(config):
        return src
    state: dict[str, torch.Tensor] = {}
    for f in weight_files(src):
        state.update(load_file(str(f)))
    generation = None
    if (src / "generation_config.json").is_file():
        generation = transformers.GenerationConfig.from_pretrained(src, local_files_only=True)
    out = Path(out_dir)
    if out.exists():
        shutil.rmtree(out)
    for f in src.iterdir():  # tokenizer files travel unchanged; save_pretrained writes the rest
        if f.is_file() and not f.name.endswith(".safetensors") and f.name not in (
                "config.json", "generation_config.json", INDEX_FILE):
            out.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, out / f.name)
    return save_weights_dir(state, config, out, untie=True, generation_config=generation,
                            max_shard_size=max_shard_size)
