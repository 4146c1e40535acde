"""The `asyncrl` command: parses arguments, loads configs, and hands off to launch/ jobs.

User mistakes (UserError: bad config, missing model dir, malformed data) print as short lines
without a traceback and exit with status 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

from asyncrl.errors import JobFailed, UserError


def _split_config_and_overrides(args: list[str]) -> tuple[str | None, list[str]]:
    """`CONFIG k=v k=v` or just `k=v ...`: the first non-override argument is the YAML path."""
    path, overrides = (args[0], args[1:]) if args and "=" not in args[0] else (None, args)
    bad = [a for a in overrides if "=" not in a]
    if bad:
        raise UserError(f"expected key.sub=value overrides after the config file, got {bad}")
    return path, overrides


def cmd_sft(ns: argparse.Namespace) -> int:
    from asyncrl.launch.sft_config import SFTRunConfig

    path, overrides = _split_config_and_overrides(ns.args)
    cfg = SFTRunConfig.load(path, overrides)
    if ns.print_config:
        return _print_config(cfg)
    from asyncrl.launch.sft import run_sft_job

    result = run_sft_job(cfg, force=ns.force)
    if os.environ.get("RANK", "0") == "0":
        print(f"model_dir={result.model_dir} eval_accuracy={result.eval_accuracy:.4f} "
              f"train_seconds={result.train_seconds:.1f} cached={result.cached}")
    return _exit_torchrun_worker(0)


def cmd_serve(ns: argparse.Namespace) -> int:
    from asyncrl.models.chat_options import ChatOptions

    bad = [a for a in ns.overrides if "=" not in a]
    if bad:
        raise UserError(f"expected key.sub=value overrides, got {bad}")
    api_key = ns.api_key or os.environ.get("ASYNCRL_SERVER_API_KEY")
    chat = [f"{key}={value}" for key, value in (("tool_parser", ns.tool_parser),
                                                ("reasoning_parser", ns.reasoning_parser),
                                                ("chat_template_kwargs", ns.chat_template_kwargs))
            if value is not None]  # a JSON object is valid YAML, which overrides parse
    ChatOptions.load(None, chat)  # an unknown parser is refused before the server's imports
    from asyncrl.launch.serve import serve, server_config_from_args

    serve(server_config_from_args(ns.model, ns.port, ns.host, api_key, chat + ns.overrides,
                                  trust_remote_code=ns.trust_remote_code))
    return 0


def cmd_view(ns: argparse.Namespace) -> int:
    from asyncrl.view.server import view

    try:
        view(ns.run_dir, ns.host, ns.port, ns.api_key or os.environ.get("ASYNCRL_VIEW_API_KEY"))
    except OSError as err:  # the port is taken, the address is not this machine's
        raise UserError(f"cannot listen on {ns.host}:{ns.port}: {err}") from err
    return 0


def cmd_eval(ns: argparse.Namespace) -> int:
    from pathlib import Path

    from rich.console import Console

    from asyncrl.launch.evaluate import parse_k_list, run_eval_job
    from asyncrl.reward.config import reward_spec_from_cli
    from asyncrl.rollout.answer_eval import EvalConfig

    given = {"pass_k": parse_k_list(ns.k, "--k") if ns.k is not None else None,
             "num_samples": ns.num_samples, "temperature": ns.temperature,
             "max_new_tokens": ns.max_new_tokens}
    cfg = EvalConfig.from_dict({k: v for k, v in given.items() if v is not None}, "options")
    reward = reward_spec_from_cli(ns.reward)  # before any model loads: a typo fails at once
    run_eval_job(ns.checkpoint, ns.data, cfg, reward=reward, limit=ns.limit,
                 json_out=Path(ns.json) if ns.json else None, console=Console(),
                 inference=_eval_inference(ns), trust_remote_code=ns.trust_remote_code)
    return 0


def _eval_inference(ns: argparse.Namespace):
    """None (the built-in engine in process), or the servers `--backend`/`--address` name."""
    if ns.backend == "builtin":
        if ns.address or ns.server_python:
            raise UserError("--address and --server-python need --backend asyncrl|vllm|sglang")
        return None
    from asyncrl.launch.train_config import InferenceLaunchConfig

    if ns.address:
        return InferenceLaunchConfig.from_dict(
            {"mode": "remote", "backend": ns.backend, "remote": {"addresses": ns.address}},
            "options")
    return InferenceLaunchConfig.from_dict(
        {"mode": "local", "backend": ns.backend, "server_python": ns.server_python}, "options")


def cmd_train(ns: argparse.Namespace) -> int:
    from asyncrl.launch.train_config import TrainRunConfig, load_run_config

    path, overrides = _split_config_and_overrides(ns.args)
    if ns.ray:  # first, so that launcher.* overrides refine it
        address = "null" if ns.ray == "local" else ns.ray
        overrides = [f"launcher={{kind: ray, address: '{address}'}}" if address != "null"
                     else "launcher={kind: ray}", *overrides]
    if ns.resume:
        if path is not None:
            raise UserError(f"--resume {ns.resume} uses the run's saved config.yaml; drop {path!r} "
                            "(overrides such as total_steps=400 are allowed)")
        cfg = load_run_config(ns.resume, overrides)
    else:
        cfg = TrainRunConfig.load(path, overrides)
    if ns.print_config:
        return _print_config(cfg)
    from asyncrl.launch.train import Trainer

    result = Trainer(cfg, run_dir=ns.resume).train(resume=bool(ns.resume))
    return _exit_torchrun_worker(_report(result) if os.environ.get("RANK", "0") == "0" else 0)


def _print_config(cfg) -> int:
    from asyncrl.config_docs import format_config

    print(format_config(cfg))
    return 0


def _report(result) -> int:
    acc = ("n/a" if result.final_accuracy is None else f"{result.final_accuracy:.4f}")
    start = ("n/a" if result.initial_accuracy is None else f"{result.initial_accuracy:.4f}")
    print(f"run_dir={result.run_dir} steps={result.steps} initial_accuracy={start} "
          f"final_accuracy={acc} train_seconds={result.train_seconds:.1f} "
          f"wall_seconds={result.wall_seconds:.1f} stopped_by={result.stopped_by}")
    return 130 if result.stopped_by == "interrupted" else 0


def _exit_torchrun_worker(code: int) -> int:
    """`code`; under torchrun every rank leaves with os._exit instead, because C++ threads of
    the torch.distributed stack torn down at interpreter exit can abort a finished worker
    ("terminate called without an active exception")."""
    if os.environ.get("WORLD_SIZE", "1") == "1":
        return code
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def cmd_build_model(ns: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from asyncrl.models.presets import build_preset_model, check_preset, ensure_preset_model

    start = time.perf_counter()
    try:
        check_preset(ns.preset)
        if ns.out_dir is None:
            out = ensure_preset_model(ns.preset, ns.dtype, ns.seed)
        else:
            out = Path(ns.out_dir)
            if (out / "config.json").exists() and not ns.force:
                raise UserError(f"{out} already holds a model (config.json); pass --force to "
                                "overwrite it")
            build_preset_model(ns.preset, out, ns.dtype, ns.seed)
    except ValueError as err:  # a bad --preset/--dtype: the message names the allowed values
        raise UserError(str(err)) from err
    print(f"model_dir={out} preset={ns.preset} seconds={time.perf_counter() - start:.1f}")
    return 0


PRINT_CONFIG_HELP = ("print every field of the config (with the file and overrides applied): "
                     "its value, its default and what it means; then exit")


TRUST_HELP = ("allow the model directory's own Python code (config.json auto_map), as "
              "transformers' trust_remote_code")


def _add_serve_parser(sub: Any) -> None:
    srv = sub.add_parser("serve", help="serve a model with the built-in engine over HTTP")
    srv.add_argument("--model", required=True,
                     help="local HF model directory, or a hub id (org/name) from the HF cache")
    srv.add_argument("--trust-remote-code", action="store_true", help=TRUST_HELP)
    srv.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--api-key", default=None,
                     help="bearer token every route but /health, /version and /metrics needs "
                          "(or ASYNCRL_SERVER_API_KEY)")
    # vLLM's flag names, so a launch script moves between the two servers unchanged
    srv.add_argument("--tool-parser", "--tool-call-parser", dest="tool_parser", default=None,
                     help="tool-call format of the model: hermes (default), llama3_json, "
                          "mistral, pythonic")
    srv.add_argument("--reasoning-parser", default=None,
                     help="split <think> reasoning into reasoning_content: none (default), "
                          "deepseek_r1, qwen3")
    srv.add_argument("--default-chat-template-kwargs", dest="chat_template_kwargs",
                     default=None, metavar="JSON",
                     help="chat template variables, e.g. '{\"enable_thinking\": false}'; a "
                          "request's chat_template_kwargs override them")
    srv.add_argument("--enable-auto-tool-choice", action="store_true",
                     help="accepted for vLLM compatibility: tool calls are always parsed when "
                          "a request has tools")
    srv.add_argument("overrides", nargs="*", metavar="key=value",
                     help="ServerConfig overrides, e.g. engine.max_num_seqs=128 engine.dtype=bfloat16")
    srv.set_defaults(func=cmd_serve)


def _add_eval_parser(sub: Any) -> None:
    from asyncrl.inference.backends import BACKENDS  # light: the choices come from the registry

    ev = sub.add_parser("eval", help="greedy accuracy and pass@k of a model or checkpoint")
    ev.add_argument("checkpoint", metavar="CHECKPOINT",
                    help="HF model dir, checkpoint dir (policy/), run dir (checkpoints/) or "
                         "hub id (org/name) from the HF cache")
    ev.add_argument("--trust-remote-code", action="store_true", help=TRUST_HELP)
    ev.add_argument("--data", required=True, metavar="FILE",
                    help="JSONL/parquet file (every row is scored), 'arithmetic' for the "
                         "built-in task's held-out split, or a dataset mapping like the run "
                         "config's data: ('{kind: hf, name: openai/gsm8k, config: main, "
                         "eval_split: test}': its held-out rows)")
    ev.add_argument("--k", default=None, metavar="K,K,...", help="pass@k values, e.g. 1,4,8")
    ev.add_argument("--num-samples", type=int, default=None, metavar="N",
                    help="samples per problem for pass@k (default: the largest k)")
    ev.add_argument("--temperature", type=float, default=None, metavar="T",
                    help="for pass@k (default 1.0)")
    ev.add_argument("--max-new-tokens", type=int, default=None, metavar="N",
                    help="default: 1024, or what the model's context leaves after the longest prompt")
    ev.add_argument("--limit", type=int, default=None, metavar="N",
                    help="score only the first N rows")
    ev.add_argument("--reward", default="exact",
                    help="exact | digits | clevr_count_70k | math | code | package.module:function | "
                         "trl:package.module:function | a YAML file or inline mapping "
                         "('{kind: judge, base_url: ..., model: ...}')")
    ev.add_argument("--json", default=None, metavar="OUT",
                    help="write the summary and per-problem records here")
    ev.add_argument("--backend", default="builtin", choices=["builtin", *BACKENDS.kinds()],
                    help="builtin: the engine in this process; otherwise servers of this kind, "
                         "started here (or --address)")
    ev.add_argument("--address", action="append", default=[], metavar="URL",
                    help="use this running server (repeatable) instead of starting one")
    ev.add_argument("--server-python", default=None, metavar="PYTHON",
                    help="the interpreter that has vLLM/SGLang installed (default: this one)")
    ev.set_defaults(func=cmd_eval)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncrl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sft = sub.add_parser("sft", help="SFT warm start of the tiny model on the synthetic task")
    sft.add_argument("args", nargs="*", metavar="CONFIG|key=value",
                     help="optional YAML config, then dotted overrides like sft.steps=100")
    sft.add_argument("--force", action="store_true", help="retrain even if a cached result exists")
    sft.add_argument("--print-config", action="store_true", help=PRINT_CONFIG_HELP)
    sft.set_defaults(func=cmd_sft)
    tr = sub.add_parser("train", help="asynchronous RL (GRPO/PPO) on a task; the main job")
    tr.add_argument("args", nargs="*", metavar="CONFIG|key=value",
                    help="optional YAML config, then dotted overrides like rollout.batch_size=32")
    tr.add_argument("--print-config", action="store_true", help=PRINT_CONFIG_HELP)
    tr.add_argument("--resume", metavar="RUN_DIR", default=None,
                    help="continue a stopped run from its latest checkpoint")
    tr.add_argument("--ray", metavar="ADDRESS", default=None,
                    help="run on a Ray cluster (launcher=ray): 'auto' (the cluster this machine "
                         "joined), HOST:PORT of its head, or 'local' (a Ray started for this "
                         "job); see the launcher.* settings of kind ray")
    tr.set_defaults(func=cmd_train)
    _add_serve_parser(sub)
    _add_eval_parser(sub)
    vw = sub.add_parser("view", help="a live web page of a run's curves, events and trajectories")
    vw.add_argument("run_dir", metavar="RUN_DIR",
                    help="a run directory, or a directory of runs (shown side by side)")
    vw.add_argument("--host", default="127.0.0.1",
                    help="address to listen on (default 127.0.0.1: this machine only)")
    vw.add_argument("--port", type=int, default=8600, help="default 8600; 0 picks a free port")
    vw.add_argument("--api-key", default=None,
                    help="key the page's data routes need (or ASYNCRL_VIEW_API_KEY); required "
                         "with a --host other than loopback")
    vw.set_defaults(func=cmd_view)
    bm = sub.add_parser("build-model", help="build a random-init model of a preset shape "
                        "(tiny, tiny-vl, tiny-qwen3-vl, tiny-moe, qwen2.5-0.5b, qwen2.5-1.5b) as a "
                        "HF directory")
    bm.add_argument("out_dir", nargs="?", default=None, metavar="OUT_DIR",
                    help="where to save it (default: the cache, reused when already built)")
    bm.add_argument("--preset", required=True, metavar="NAME",
                    help="tiny | tiny-vl | tiny-qwen3-vl | tiny-moe | qwen2.5-0.5b | qwen2.5-1.5b")
    bm.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="weights dtype (default: bfloat16 for Qwen presets, float32 for tiny)")
    bm.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    bm.add_argument("--force", action="store_true", help="overwrite a model already in OUT_DIR")
    bm.set_defaults(func=cmd_build_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = ns.func
    try:
        return func(ns)
    except UserError as err:
        for line in str(err).splitlines():
            print(f"asyncrl {ns.command}: error: {line}", file=sys.stderr)
        return 2
    except JobFailed as err:
        print(f"asyncrl {ns.command}: failed: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"asyncrl {ns.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
