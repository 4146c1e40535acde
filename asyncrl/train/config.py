"""The train package's settings: the engines (policy, critic), the optimizer, LoRA, the PPO actor
and its loss, the advantage estimators, the proximal policy, SFT.

Plain pydantic, no torch: a run config (and `asyncrl train --print-config`) loads without
importing the code these settings configure. What a run derives (the LR schedule's horizon from
`total_steps`, the trainer's temperature from the sampler's) is not a setting here: the job
passes it to the engine it builds.
"""

from __future__ import annotations

import inspect
from typing import Any, Literal

import pydantic

from asyncrl.config import Config
from asyncrl.errors import UserError
from asyncrl.imports import import_object
from asyncrl.models.device import check_device_spec
from asyncrl.plugins import Registry

LossAgg = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum",
                  "seq_mean_token_sum_norm"]
KLKind = Literal["k1", "k2", "k3"]
Estimator = Literal["grpo", "rloo", "drgrpo", "reinforce_pp", "reinforce_pp_baseline", "gae"]
TruncationMode = Literal["keep", "mask_loss", "zero_reward"]
ProximalSource = Literal["recompute", "loglinear", "behaviour"]

# every linear projection of a Llama/Qwen2 decoder layer (attention and MLP); QLoRA's choice
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                        "down_proj")
# adapting these breaks the tie of the embedding and the output head, and the engines merge
# Linear layers of the decoder only
REFUSED_LORA_TARGETS = ("embed_tokens", "lm_head")


class OptimizerConfig(Config):
    lr: float = pydantic.Field(1e-3, gt=0.0, le=1.0)  # AdamW peak learning rate
    betas: tuple[float, float] = (0.9, 0.95)  # AdamW moment decay rates
    eps: float = pydantic.Field(1e-8, gt=0.0)  # AdamW denominator epsilon
    weight_decay: float = pydantic.Field(0.0, ge=0.0)  # AdamW decoupled weight decay
    warmup_steps: int = pydantic.Field(0, ge=0)  # linear warm-up steps from 0 to lr
    schedule: Literal["constant", "linear", "cosine"] = "constant"  # the learning rate after warm-up
    # linear/cosine decay ends at lr * this
    min_lr_ratio: float = pydantic.Field(0.0, ge=0.0, le=1.0)
    # max global gradient norm; None: no clipping
    grad_clip: float | None = pydantic.Field(1.0, gt=0.0)

    @pydantic.field_validator("betas")
    @classmethod
    def _betas_in_unit_interval(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError(f"betas={list(v)} must each be in [0, 1)")
        return v


class LoraConfig(Config):
    """`train.lora`: None (the default) trains every weight; any field set turns LoRA on
    (`train.lora.r=8`), `enabled: false` turns it off again."""

    enabled: bool = True
    r: int = pydantic.Field(8, ge=1, le=1024)
    alpha: float = pydantic.Field(16.0, gt=0.0)  # the update is scaled by alpha / r
    dropout: float = pydantic.Field(0.0, ge=0.0, lt=1.0)  # on the LoRA input, training only
    target_modules: list[str] = list(DEFAULT_LORA_TARGETS)  # module names (suffixes), as PEFT takes

    @pydantic.field_validator("target_modules")
    @classmethod
    def _linear_decoder_modules(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError(f"target_modules=[] is empty; allowed: module names such as "
                             f"{list(DEFAULT_LORA_TARGETS)}")
        bad = [m for m in value if any(r in m for r in REFUSED_LORA_TARGETS)]
        if bad:
            raise ValueError(f"target_modules={value} contains {bad}; allowed: the decoder's "
                             f"linear layers, e.g. {list(DEFAULT_LORA_TARGETS)} (not "
                             f"{list(REFUSED_LORA_TARGETS)})")
        return value

    @property
    def scale(self) -> float:
        return self.alpha / self.r


def lora_enabled(cfg: LoraConfig | None) -> bool:
    return cfg is not None and cfg.enabled


class TrainEngineConfig(Config):
    """How a model trains: micro-batching, attention layout, precision, device, optimizer."""

    # micro-batch size in tokens (sequences are packed). None: 1024 on a CPU; on a GPU sized
    # for the card and the model (`micro_batch_tokens`)
    max_tokens_per_mb: int | None = pydantic.Field(None, ge=1)
    # How a micro-batch's samples reach the model. "packed": one row, attention over each
    # sample's own tokens only (train/varlen_attention.py: torch's varlen kernel on CUDA, one
    # SDPA call per sample elsewhere; flash-attention models keep their kernel), nothing computed
    # for padding. "padded": k right-padded rows with an attention mask (needed for images).
    # "auto": padded for a vision-language model; else packed on CUDA, and on a CPU padded
    # while that computes at most 1.25 positions per real token (engine.auto_pads), packed
    # beyond; either way a micro-batch whose shared prompts (below) compute no more positions
    # takes that layout.
    attention_layout: Literal["auto", "packed", "padded"] = "auto"
    # Samples of a micro-batch with the same prompt (a GRPO group) run it once; their
    # continuations attend to it through a KV cache, gradients flow into it from all of them.
    # Always in the padded layout, where it pays in auto. Not used with gradient checkpointing
    # (which drops the cache), the packed layout, or FSDP.
    share_prefixes: bool = True
    # Logprobs (and entropies) from the last hidden states this many tokens at a time, never
    # holding the [tokens, vocab] logits (train/chunked_logprobs.py), in a micro-batch whose
    # fp32 logits would exceed 256 MiB (engine.CHUNK_ABOVE_BYTES); 0: always the full logits.
    # Single-process policies whose head is a plain linear layer; others compute full logits.
    logprob_chunk_tokens: int = pydantic.Field(1024, ge=0)
    optimizer: OptimizerConfig = OptimizerConfig()
    # bf16 autocast keeps fp32 master weights and optimizer state; "none" runs in model dtype;
    # "auto": bf16 on a CUDA device that has it, else none. Under FSDP bf16 also gathers the
    # weights in bf16 (fsdp.mixed_precision).
    autocast_dtype: Literal["auto", "none", "bfloat16"] = "auto"
    gradient_checkpointing: bool = False  # recompute activations in backward (less memory)
    # None or auto: the current CUDA device when torch sees one (a torchrun rank's own), else cpu
    device: str | None = None
    _known_device = pydantic.field_validator("device")(check_device_spec)

    def uses_bf16(self, device: Any) -> bool:
        """Whether compute runs in bf16 autocast on `device` (a torch.device)."""
        if self.autocast_dtype != "auto":
            return self.autocast_dtype == "bfloat16"
        import torch

        return device.type == "cuda" and torch.cuda.is_bf16_supported()

    def micro_batch_tokens(self, model_config: Any, device: Any) -> int:
        """`max_tokens_per_mb`, or its default: 1024 on a CPU; on a GPU the power of two whose
        activations (about 40 bytes per layer and hidden unit of a token) fill a third of the
        card's memory, in [1024, 32768]."""
        if self.max_tokens_per_mb is not None:
            return self.max_tokens_per_mb
        if device.type != "cuda":
            return 1024
        import torch

        text = getattr(model_config, "text_config", None) or model_config
        per_token = 40 * text.num_hidden_layers * text.hidden_size
        memory = torch.cuda.get_device_properties(device).total_memory
        return default_gpu_micro_batch(memory, per_token)


def default_gpu_micro_batch(memory_bytes: int, bytes_per_token: int) -> int:
    """The largest power of two of tokens whose activations fit a third of `memory_bytes`,
    clamped to [1024, 32768]."""
    fit = memory_bytes // 3 // max(1, bytes_per_token)
    tokens = 1024
    while tokens * 2 <= min(fit, 32768):
        tokens *= 2
    return tokens


class PolicyTrainConfig(TrainEngineConfig):
    """The policy's engine (`train:`): TrainEngineConfig plus LoRA."""

    # LoRA (train/lora.py): None trains every weight; set, only the adapter trains and only the
    # adapter is pushed to the engines
    lora: LoraConfig | None = None


class CriticConfig(TrainEngineConfig):
    """The critic of `actor.advantage.estimator: gae` (`critic:`): a value head on the policy's
    body, trained alongside the policy and checkpointed with the run."""

    # the value update is clipped around the values the critic had when the batch arrived;
    # None: no clip
    value_eps_clip: float | None = pydantic.Field(0.2, gt=0.0)


class PPOLossConfig(Config):
    """The settings of the built-in policy loss (`PPOLoss`, decoupled PPO): clip range,
    behaviour importance weights, ratio level, objective, loss aggregation, entropy and KL terms.

    In a run it is the `actor.ppo` section of `TrainRunConfig`, loaded with the rest of it.
    Standalone: `PPOLossConfig(eps_clip=0.2)`, or `PPOLossConfig.from_dict(data)` (`data` laid
    over the defaults). Unknown keys, out-of-range values and settings that contradict each
    other (e.g. `behav_imp_weight_mode: icepop` without `behav_imp_weight_cap`) raise
    ValueError naming the field: `ConfigError` from `from_dict` / `load`,
    `pydantic.ValidationError` from the constructor.
    """

    # PPO clip range of the policy ratio: [1 - eps, 1 + eps]
    eps_clip: float = pydantic.Field(0.2, gt=0.0, lt=1.0)
    # DAPO clip-higher: a wider upper bound lets low-probability tokens grow (keeps entropy up).
    eps_clip_higher: float | None = pydantic.Field(None, gt=0.0)
    # Dual clip: bounds the loss of a negative-advantage token whose ratio has exploded.
    c_clip: float | None = pydantic.Field(None, gt=1.0)
    # false: no token is reweighted by w = pi_prox / pi_behav (w = 1); the clip stays centred on
    # the proximal policy (AReaL's recompute_logprob without use_decoupled_loss, its default)
    behav_imp_weight: bool = True
    # Bound on w = pi_prox / pi_behav (staleness and sampler mismatch, see corrections.py);
    # None trusts the raw weight. cap: truncated IS; mask: masked IS; icepop: two-sided masking
    # (also below behav_imp_weight_floor, default 1 / cap).
    behav_imp_weight_cap: float | None = pydantic.Field(None, gt=1.0)
    # how the bound on pi_prox / pi_behav is applied (see above)
    behav_imp_weight_mode: Literal["cap", "mask", "icepop"] = "cap"
    # the lower bound: cap raises weights below it to it, mask / icepop drop them (icepop's
    # default 1 / cap; None: no lower bound)
    behav_imp_weight_floor: float | None = pydantic.Field(None, gt=0.0, lt=1.0)
    # mask / icepop: the dropped tokens leave the step's normaliser too, so the kept ones keep
    # their weight (verl's IcePop); false: they count in it and the step shrinks. Needs
    # proximal_logprobs: recompute (the weights are known before the step).
    behav_imp_weight_renormalize: bool = False
    # token: one weight per token; sequence: per sequence (geometric mean); sequence_product:
    # per sequence, the product of token weights (verl, TRL); None: ratio_level's
    behav_imp_weight_level: Literal["token", "sequence", "sequence_product"] | None = None
    # sequence: GSPO; sequence_token: GSPO-token (the sequence ratio's value, per-token gradient)
    ratio_level: Literal["token", "sequence", "sequence_token"] = "token"
    # ppo: the clipped surrogate; cispo: clipped IS weight on REINFORCE; dppo_tv / dppo_kl:
    # Divergence PPO, a trust region on each token's probability (eps_clip / eps_clip_higher
    # are its thresholds, c_clip caps the weight; corrections.py)
    policy_objective: Literal["ppo", "cispo", "dppo_tv", "dppo_kl"] = "ppo"
    loss_agg: LossAgg = "token_mean"  # how token losses become one number (see aggregation.py)
    # seq_mean_token_sum_norm's constant: token sums / (sequences x this), Dr.GRPO's batch x max
    # length and verl's seq-mean-token-sum-norm (typically gconfig.max_new_tokens)
    loss_agg_horizon: int | None = pydantic.Field(None, ge=1)
    entropy_coef: float = pydantic.Field(0.0, ge=0.0)  # weight of the entropy bonus; 0 off
    kl_coef: float = pydantic.Field(0.0, ge=0.0)  # weight of the KL to the reference policy; 0 off
    kl_kind: KLKind = "k3"  # estimator of the per-token KL
    # "reward": the trainer subtracts kl_coef * KL from token rewards (regularizers.kl_reward)
    # before advantages; "loss": ppo_actor_loss adds kl_coef * KL with gradient.
    kl_as: Literal["reward", "loss"] = "loss"

    @property
    def clip_high(self) -> float:
        """Returns the upper clip range: `eps_clip_higher` when set, else `eps_clip`."""
        return self.eps_clip if self.eps_clip_higher is None else self.eps_clip_higher

    @property
    def weight_level(self) -> str:
        """The behaviour weight's level: its own, else the ratio's (GSPO-token: sequence)."""
        level = self.behav_imp_weight_level or self.ratio_level
        return "sequence" if level == "sequence_token" else level

    @pydantic.model_validator(mode="after")
    def _consistent(self) -> PPOLossConfig:
        if not self.behav_imp_weight:
            bound = {k: v for k, v in self.model_dump(include={
                "behav_imp_weight_cap", "behav_imp_weight_floor", "behav_imp_weight_level",
                "behav_imp_weight_renormalize"}).items() if v not in (None, False)}
            if bound:
                raise ValueError(f"behav_imp_weight=false uses no weight, so {bound} would "
                                 "change nothing; unset them or set behav_imp_weight=true")
        if self.behav_imp_weight_mode == "icepop" and self.behav_imp_weight_cap is None:
            raise ValueError("behav_imp_weight_mode='icepop' needs behav_imp_weight_cap (the upper "
                             "bound; the lower is behav_imp_weight_floor, default 1 / cap)")
        if self.behav_imp_weight_floor is not None and self.behav_imp_weight_cap is None:
            raise ValueError(f"behav_imp_weight_floor={self.behav_imp_weight_floor} needs "
                             "behav_imp_weight_cap (the upper bound)")
        if self.behav_imp_weight_renormalize and (
                self.behav_imp_weight_mode == "cap" or self.behav_imp_weight_cap is None):
            raise ValueError("behav_imp_weight_renormalize drops the tokens a bound removes: it "
                             "needs behav_imp_weight_cap and behav_imp_weight_mode mask or icepop")
        if (self.loss_agg == "seq_mean_token_sum_norm") != (self.loss_agg_horizon is not None):
            raise ValueError("loss_agg='seq_mean_token_sum_norm' and loss_agg_horizon go together "
                             "(the constant, e.g. gconfig.max_new_tokens); got loss_agg="
                             f"{self.loss_agg!r}, loss_agg_horizon={self.loss_agg_horizon}")
        if self.policy_objective.startswith("dppo") and self.ratio_level != "token":
            raise ValueError(f"policy_objective={self.policy_objective!r} bounds each token's "
                             "probability: it takes ratio_level='token'")
        if self.policy_objective == "cispo" and (self.ratio_level != "token" or self.c_clip):
            raise ValueError("policy_objective='cispo' clips a per-token weight: it takes "
                             "ratio_level='token' and no c_clip")
        return self


class AdvantageConfig(Config):
    estimator: Estimator = "grpo"  # how advantages are computed from rewards (gae: with the critic)
    # added to the group's reward std before dividing (peers: 1e-6 TRL, verl; 1e-5, 1e-4 others)
    std_eps: float = pydantic.Field(1e-6, gt=0.0)
    # grpo, a group of one sample: "zero" (no comparison, no signal) or "raw": r / (1 + std_eps),
    # verl's convention (its group mean 0 and std 1)
    singleton_group: Literal["zero", "raw"] = "zero"
    # after the estimator: (A - mean) / sqrt(var + whiten_eps) over every loss token of the step
    # (token-level whitening: verl's masked_whiten for GAE and REINFORCE++, AReaL's adv_norm)
    whiten: bool = False
    whiten_eps: float = pydantic.Field(1e-8, gt=0.0)  # added to the variance under the sqrt
    gamma: float = pydantic.Field(1.0, ge=0.0, le=1.0)  # GAE only
    lam: float = pydantic.Field(1.0, ge=0.0, le=1.0)  # GAE only
    # rewards become clip((r - reward_bias) * reward_scale, -reward_clip, reward_clip)
    reward_scale: float = pydantic.Field(1.0, gt=0.0)
    reward_bias: float = 0.0  # subtracted from every reward first
    # None: no clipping
    reward_clip: float | None = pydantic.Field(None, gt=0.0)
    # DAPO soft overlong punishment; None disables. max_len is the generation limit (new tokens).
    overlong_buffer_len: int | None = pydantic.Field(None, ge=1)
    # the generation limit the soft penalty counts back from
    overlong_max_len: int | None = pydantic.Field(None, ge=1)
    # the penalty at max_len, growing linearly over the buffer
    overlong_penalty_factor: float = pydantic.Field(1.0, ge=0.0)
    # a completion cut at max_new_tokens: kept, its reward set to 0, or its loss masked
    truncated: TruncationMode = "keep"
    # GAE: a row cut at the length limit bootstraps from the critic's value of the state after
    # its last token (AReaL) instead of ending there with value 0
    truncated_bootstrap: bool = False

    @pydantic.model_validator(mode="after")
    def _check_overlong(self) -> AdvantageConfig:
        if self.singleton_group != "zero" and self.estimator != "grpo":
            raise ValueError(f"singleton_group={self.singleton_group!r} applies to "
                             f"estimator='grpo' only; estimator={self.estimator!r}")
        if self.whiten and self.estimator == "reinforce_pp_baseline":
            raise ValueError("estimator='reinforce_pp_baseline' already whitens over the step's "
                             "tokens; leave whiten false")
        if self.truncated_bootstrap and self.estimator != "gae":
            raise ValueError("truncated_bootstrap needs a critic's values: estimator='gae' only; "
                             f"estimator={self.estimator!r}")
        if self.truncated_bootstrap and self.truncated == "mask_loss":
            raise ValueError("truncated_bootstrap with truncated='mask_loss' changes nothing: a "
                             "truncated row has no loss tokens; use 'keep' or 'zero_reward'")
        if self.overlong_buffer_len is None:
            return self
        if self.overlong_max_len is None:
            raise ValueError(
                f"overlong_buffer_len={self.overlong_buffer_len} needs overlong_max_len "
                "(the generation limit in tokens)"
            )
        if self.overlong_buffer_len > self.overlong_max_len:
            raise ValueError(
                f"overlong_buffer_len={self.overlong_buffer_len} is out of range; "
                f"allowed [1, overlong_max_len={self.overlong_max_len}]"
            )
        return self


class ProximalConfig(Config):
    # the proximal policy's logprobs: interpolated between behaviour and current by version
    # (loglinear: no extra forward pass), a forward pass before the step (recompute), or the
    # behaviour's (naive PPO); how each fares at eta 4 and 8: the staleness ablation's record
    # (benchmarks/results/staleness_ablation*.json).
    proximal_logprobs: ProximalSource = "loglinear"

    @property
    def needs_forward_pass(self) -> bool:
        """Whether the train engine must run the extra pre-update forward pass."""
        return self.proximal_logprobs == "recompute"


class PPOLossChoice(Config):
    """`actor.loss: ppo`: the built-in decoupled PPO loss (train/losses.py), set by `actor.ppo`."""

    kind: Literal["ppo"] = "ppo"  # the loss (LOSSES: ppo | custom | yours)

    def build(self, actor: PPOActorConfig) -> Any:
        from asyncrl.train.losses import PPOLoss

        return PPOLoss(actor.ppo)


class CustomLossConfig(Config):
    """`actor.loss: {path: package.module:Loss, kwargs: {...}}` (or just the path): your
    `PolicyLoss` (api/loss.py). A class or factory there is called with `kwargs`."""

    kind: Literal["custom"] = "custom"  # the loss (LOSSES: ppo | custom | yours)
    path: str = pydantic.Field(description="package.module:LossClassOrFunction")
    kwargs: dict[str, Any] = {}  # keyword arguments of the class or factory

    def build(self, actor: PPOActorConfig) -> Any:
        from asyncrl.api import PolicyLoss

        loss = import_object(self.path, "actor.loss")
        if inspect.isclass(loss) or self.kwargs:
            loss = loss(**self.kwargs)
        if not isinstance(loss, PolicyLoss):
            raise UserError(f"actor.loss {self.path!r} gave {loss!r}, not a PolicyLoss: a callable "
                            "loss(logprobs, inputs: LossInputs, normalizer) -> (loss, stats) with "
                            "`normalize_by` ('tokens' or 'sequences') and `needs_entropy`")
        return loss


LOSSES: Registry = Registry("loss", shorthand=lambda path: {"kind": "custom", "path": path},
                           infer_kind=lambda m: "custom" if "path" in m else None)
LOSSES.register(PPOLossChoice)
LOSSES.register(CustomLossConfig)
LossConfig = LOSSES.field()


class MoeConfig(Config):
    """A mixture-of-experts policy's routing (train/route_replay.py). Whatever is set here, such
    a policy's steps report the route-flip share (moe/route_flip_frac) when its engines return
    routes (the built-in engine in process)."""

    # Rollout routing replay (R3): the trainer routes each token to the experts the engine chose
    # for it, weighted by its own router's probabilities of them (the router still learns); each
    # step also measures the logprob gap without replay (one more forward, moe/*). Refused for a
    # dense model; engines that return no routes (servers) train without it, said at start.
    routing_replay: bool = False


class PPOActorConfig(Config):
    ppo: PPOLossConfig = PPOLossConfig()
    advantage: AdvantageConfig = AdvantageConfig()
    proximal: ProximalConfig = ProximalConfig()
    # Optimizer steps per batch, each on a slice of whole groups; the proximal policy and the
    # advantages stay those of the start of the batch, so from the second step on the PPO clip
    # bounds how far the policy moves. The policy version still advances by one per batch.
    ppo_n_minibatches: int = pydantic.Field(1, ge=1)
    # The policy loss: ppo (the built-in, set by `ppo` above), or your PolicyLoss
    # (package.module:Loss, or {path: ..., kwargs: {...}}); a registered kind of LOSSES
    loss: LossConfig = pydantic.Field(
        "ppo", description="ppo | package.module:Loss | {path: ..., kwargs: {...}}")
    moe: MoeConfig = MoeConfig()

    @pydantic.model_validator(mode="after")
    def _renormalize_needs_recompute(self) -> PPOActorConfig:
        if self.ppo.behav_imp_weight_renormalize and not self.proximal.needs_forward_pass:
            raise ValueError("ppo.behav_imp_weight_renormalize needs proximal.proximal_logprobs="
                             "'recompute' (the weights must be known before the step); got "
                             f"{self.proximal.proximal_logprobs!r}")
        return self


class SFTConfig(Config):
    steps: int = pydantic.Field(300, ge=1)  # optimizer steps
    batch_size: int = pydantic.Field(64, ge=1)  # rows per step
    eval_every: int = pydantic.Field(0, ge=0, description="0 = evaluate only at the end")
    eval_size: int = pydantic.Field(256, ge=1)  # held-out rows of the greedy accuracy eval
    eval_max_new_tokens: int = pydantic.Field(16, ge=1)  # generation limit of the eval
    log_every: int = pydantic.Field(10, ge=1)  # steps between log lines
    seed: int = 0  # row order and label noise
    # Systematically biased demonstrations: this fraction of training rows (chosen by a seeded
    # hash of the row id) shows integer answers shifted by `label_noise_offset`. A model trained
    # on them knows the arithmetic but has learned a wrong habit, which a verifier-driven RL
    # run can correct; 0 trains on clean labels. Held-out evaluation always uses true answers.
    label_noise: float = pydantic.Field(0.0, ge=0.0, le=1.0)
    label_noise_offset: int = 1  # how far the noisy answers are shifted
