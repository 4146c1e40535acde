"""The tables of the documentation's results pages, generated from the records in
benchmarks/results/.

    python benchmarks/results_pages.py           # rewrite every generated table
    python benchmarks/results_pages.py --check   # exit 1 naming each table that is out of date

A page marks each generated table with `<!-- generated: NAME -->` ... `<!-- /generated -->`;
everything between the markers is this script's, the prose around them the page's. Each table
ends with the command that produced its record and the machine it ran on, read from the record.
tests/test_docs.py runs --check, so a record rerun without its page failing CI.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from async_real import time_to  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOCS = ROOT / "docs" / "results"
BLOCK = re.compile(r"(?P<indent>[ ]*)(<!-- generated: (?P<name>[\w-]+) -->\n)(?P<body>.*?)"
                   r"([ ]*<!-- /generated -->)",
                   re.S)


def markdown_table(columns: list[str] | tuple[str, ...], rows: list, rec: dict | None = None
                   ) -> str:
    """A markdown table of string cells, then the record's command and machine when given."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    text = "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows]) + "\n"
    return text if rec is None else text + "\n" + machine_line(rec) + "\n"


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def warm_start_took(sft: dict) -> str:
    """How a record's warm start came to be; its time is a measurement only when this command
    trained it, or when it ships (asyncrl/warm_starts/ records the time it took to make)."""
    if sft.get("source") == "shipped":
        return f"shipped with the package; {sft['train_seconds']:.0f} s of training to make"
    return (f"{sft['train_seconds']:.0f} s of training" if sft.get("trained_here")
            else "built before the command")


def record(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def machine_line(rec: dict) -> str:
    m = rec.get("machine") or rec  # (some records keep the machine's fields at the top)
    cpus = m.get("cpus")
    parts = [f"{len(cpus) if isinstance(cpus, list) else cpus} CPU cores"] if cpus else []
    if m.get("torch"):
        parts.append(f"torch {m['torch']}")
    threads = m.get("threads") or m.get("machine_threads")
    if threads:
        parts.append(f"{threads} threads")
    if m.get("fp32_gflops"):
        parts.append(f"fp32 matmul {m['fp32_gflops']:.0f} GFLOP/s")
    if m.get("matmul_gflops_before_after"):
        before, after = m["matmul_gflops_before_after"]
        parts.append(f"fp32 matmul {before} GFLOP/s before the runs, {after} after")
    date = f", {rec['date']}" if rec.get("date") else ""
    return f"Command: `{rec['command']}`; machine: {', '.join(parts)}{date}."


def seeds_table(name: str) -> Callable[[], str]:
    """A main_job.py record (the main job, the VLM job): one row per seed, the mean, the worst."""
    def table() -> str:
        rec = record(name)
        target = rec.get("gain_target", 0.3)
        budget = round(min(s["train_seconds"] for s in rec["seeds"]), -1)  # the stop, to 10 s
        rows = [f"| seed | steps | s/step | greedy acc, step 0 | after {budget:.0f} s of training "
                f"| best eval | gain | training s to +{target:.0%} |",
                "|---|---|---|---|---|---|---|---|"]
        for s in rec["seeds"]:
            t = s["seconds_to_gain_target"]
            rows.append(f"| {s['seed']} | {s['steps']} | {s['seconds_per_step']:.2f} | "
                        f"{pct(s['initial_accuracy'])} | {pct(s['final_accuracy'])} | "
                        f"{pct(s['best_accuracy'])} | {s['gain'] * 100:+.1f} points | "
                        f"{'-' if t is None else f'{t:.0f}'} |")
        m = rec["summary"]
        steps = round(statistics.mean(s["steps"] for s in rec["seeds"]))
        rows.append(f"| **mean** | {steps} | {m['mean_seconds_per_step']:.2f} | "
                    f"{pct(m['mean_initial'])} | **{pct(m['mean_final'])}** | | "
                    f"**{m['mean_gain'] * 100:+.1f} points** | |")
        rows.append(f"| **worst** | | | | **{pct(m['worst_final'])}** | | "
                    f"**{m['worst_gain'] * 100:+.1f} points** | |")
        sft = rec.get("sft")
        tail = [machine_line(rec)]
        if sft:
            tail.append(f"Warm start: {sft['steps']} SFT steps ({warm_start_took(sft)}), greedy "
                        f"accuracy {pct(sft['eval_accuracy'])} at its end.")
        return "\n".join(rows) + "\n\n" + " ".join(tail) + "\n"
    return table


def tools_table() -> str:
    """bench_async.py --tails: per r and eta, the mean over seeds, and the ratio of the time to
    the middle target against eta 0's (per seed)."""
    rec = record("bench_async_agents.json")
    target, runs = rec["middle_target"], rec["runs"]
    rows = ["| r | eta | steps/s | engine idle | trainer waits | tool p50 / p99 | staleness | "
            f"acc. end | to {target:.0%} | vs eta 0 (per seed) |",
            "|---|-----|---------|-------------|---------------|----------------|-----------|"
            "----------|--------|---------------------|"]
    for tail in sorted({r["tail"] for r in runs}, reverse=True):
        for eta in sorted({r["eta"] for r in runs if r["tail"] == tail}):
            cell = [r for r in runs if r["tail"] == tail and r["eta"] == eta]
            avg = lambda key: statistics.mean(r[key] for r in cell)  # noqa: E731
            to = statistics.mean(time_to(r, target)[0] for r in cell)
            p99 = avg("tool_latency_p99_s")
            if eta:
                ratio = rec["time_to_target_ratio"][f"r={tail:g}"][f"eta={eta}"]
                seeds = ", ".join(f"{v['ratio']:.2f}{'+' if v['censored'] else ''}"
                                  for v in ratio["per_seed"].values())
                vs = f"{ratio['mean']:.2f} ({seeds})"
            else:
                vs = "1.00"
            rows.append(f"| {tail:g} | {eta} | {avg('steps_per_s'):.3f} | "
                        f"{avg('engine_generating_idle_frac'):.0%} | {avg('trainer_idle_frac'):.0%}"
                        f" | {avg('tool_latency_p50_s'):.2f} / {p99:.{2 if p99 < 10 else 1}f} s | "
                        f"{avg('staleness_mean'):.2f} | {pct(avg('final_accuracy'))} | {to:.0f} s"
                        f" | {vs} |")
    note = (f"Means over {len({r['seed'] for r in runs})} seeds; {rec['ratio_definition']} "
            "(+ marks a ratio with a censored run). " + machine_line({"command": rec["command"],
                                                                 "cpus": rec.get("cpus", [])}))
    return "\n".join(rows) + "\n\n" + note + "\n"


def moe_table() -> str:
    """moe_job.py: per (replay, eta), the mean over seeds."""
    rec = record("moe_job.json")
    sci = lambda x: "-" if x is None else f"{x:.1e}"  # noqa: E731
    rows = ["| replay | eta | seeds | steps | acc. step 0 | acc. end | reward, last 10 steps | "
            "route flips, fresh | route flips, stale | logprob gap mean / max | gap without "
            "replay mean / max |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, m in rec["means"].items():
        seeds = [r for r in rec["runs"] if r["replay"] == m["replay"] and r["eta"] == m["eta"]]
        rows.append(f"| {'on' if m['replay'] else 'off'} | {m['eta']} | {len(seeds)} | "
                    f"{m['steps']} | {pct(m['initial_accuracy'])} | {pct(m['final_accuracy'])} | "
                    f"{m['reward_last10']:.3f} | {pct(m['flip_fresh'])} | "
                    f"{pct(m['flip_stale'])} | {sci(m['gap_mean'])} / {sci(m['gap_max'])} | "
                    f"{sci(m['gap_unreplayed_mean'])} / {sci(m['gap_unreplayed_max'])} |")
    per_seed = "; ".join(
        f"replay {'on' if r['replay'] else 'off'}, eta {r['eta']}, seed {r['seed']}: "
        f"{pct(r['final_accuracy'])}"
        for r in sorted(rec["runs"], key=lambda r: (r["replay"], r["eta"], r["seed"])))
    return ("\n".join(rows) + f"\n\nEach run {rec['max_train_seconds']:g} s of training. "
            f"Held-out accuracy at the end, per run: {per_seed}. " + machine_line(rec) + "\n")


ARCH_LABELS = {"qwen2": "Qwen2 / 2.5", "qwen3": "Qwen3 (q/k norms)",
               "llama3": "Llama 3.1 (llama3 RoPE)", "gemma3": "Gemma 3 (sliding + global layers)",
               "mistral": "Mistral (sliding window)", "qwen3-moe": "Qwen3-MoE",
               "mixtral": "Mixtral"}


def archs_table(name: str) -> Callable[[], str]:
    """bench_engine_archs.py: per architecture and batch, native / fallback / HF generate."""
    def table() -> str:
        rec = record(name)
        batches = sorted({r["batch"] for r in rec["rows"]})
        archs = list(dict.fromkeys(r["arch"] for r in rec["rows"]))
        head = ["architecture", *[f"batch {b}" + (": native / fallback / HF `generate`"
                                                  if k == 0 else "")
                                  for k, b in enumerate(batches)]]
        rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for arch in archs:
            cells = []
            for b in batches:
                r = next(x for x in rec["rows"] if x["arch"] == arch and x["batch"] == b)
                cells.append(" / ".join(f"{r[k]:,.0f}" for k in (
                    "native_tok_s", "fallback_tok_s", "hf_generate_tok_s")))
            rows.append(f"| {ARCH_LABELS.get(arch, arch)} | " + " | ".join(cells) + " |")
        return "\n".join(rows) + "\n\n" + machine_line(rec) + "\n"
    return table


def ratio(ours: float, theirs: float | None) -> str:
    return f"{ours / theirs:.1f}x" if theirs else "-"


def tok_s(x: float | None) -> str:
    return f"{x:,.0f}" if x else "-"


def engine_vs_servers_table() -> str:
    """bench_engine.py: per batch, tokens/s of HF generate, ours, vLLM-CPU, SGLang, and ratios."""
    rec = record("bench_engine_sglang.json")
    return markdown_table(
        ["batch", "HF `generate`", "asyncrl engine", "vLLM-CPU", "SGLang", "ours/HF",
         "ours/vLLM", "ours/SGLang"],
        [[str(r["batch"]), tok_s(r["hf"]), tok_s(r["ours"]), tok_s(r["vllm"]),
          tok_s(r["sglang"]), ratio(r["ours"], r["hf"]), ratio(r["ours"], r["vllm"]),
          ratio(r["ours"], r["sglang"])] for r in rec["rows"]], rec)


def vlm_engine_table() -> str:
    """bench_vlm.py: per batch, tokens/s of transformers generate and the engine's two paths."""
    rec = record("bench_vlm.json")
    return markdown_table(
        ["batch", "transformers `generate`", "engine (compact)",
         "engine (transformers fallback)", "compact / generate"],
        [[str(r["batch"]), *(f"{tok_s(r[k])} tok/s" for k in (
            "hf_tokens_per_s", "native_tokens_per_s", "fallback_tokens_per_s")),
          f"{r['native_over_hf']:.1f}x"] for r in rec["by_batch"]], rec)


def staleness_table(name: str, runs: bool) -> Callable[[], str]:
    """A staleness_ablation.py record: each cell at its best rate, or every run by rate."""
    def table() -> str:
        import staleness_ablation as ablation

        rec, cells = ablation.record_cells(RESULTS / name)
        command = ("python benchmarks/staleness_ablation.py --from-record "
                   f"benchmarks/results/{name} --markdown")
        rec = {**rec, "command": command}
        if runs:
            return markdown_table(ablation.COLUMNS, ablation.table_rows(cells), rec)
        return markdown_table(ablation.TUNED_COLUMNS, ablation.tuned_rows(cells), rec)
    return table


def load_table() -> str:
    """load_tools.py, both modes: episodes (the rate: the record's, submitted episodes over the
    time until the last returned, the drain after the load included), losses, tool calls, and
    memory and descriptors from the per-10 s samples after the first minute (the warm-up)."""
    rows, commands = [], []
    for mode in ("workflow", "proxy"):
        rec = record(f"load_tools_{mode}.json")
        commands.append(f"`{rec['command']}`")
        after = [x for x in rec["samples"] if x["t"] >= 60]
        calls = rec["service_calls"]
        refused = calls.get("bad_call", 0) + calls.get("unknown_tool", 0)

        def span(key: str) -> str:
            return f"{min(x[key] for x in after):,}-{max(x[key] for x in after):,}"

        rows.append([
            mode, f"{rec['returned']:,} / {rec['submitted']:,} "
            f"({rec['episodes_per_s']:.1f}/s)", f"{rec['lost']} / {rec['duplicated']}",
            f"{calls['answer']:,} / {calls['error']:,}"
            + (f" (+{refused} refused calls)" if refused else ""),
            f"{after[0]['rss_mib']:,.1f} -> {after[-1]['rss_mib']:,.1f} MiB", span("fds"),
            f"{after[0]['service_rss_mib']:.1f} -> {after[-1]['service_rss_mib']:.1f} MiB / "
            f"{span('service_fds')}"])
    columns = ["", "episodes (returned / submitted)", "lost / duplicated",
               "tool calls answered / 503s", "RSS, minute 1 -> 10",
               "open descriptors after minute 1", "service RSS / descriptors"]
    return markdown_table(columns, rows) + "\nCommands: " + "; ".join(commands) + ".\n"


def chain_async_table() -> str:
    """bench_async.py --mode real on the chain job: per (eta, placement), the mean over seeds
    against the synchronous loop (async_real.report_rows, the same figures as --report)."""
    from async_real import report_rows

    rec, target = record("bench_async_real.json"), 0.30
    columns = ["eta", "placement", "steps/s", "vs sync", "engine idle", "final acc.",
               f"time to {target:.0%} (seeds that got there)", "vs sync"]
    return markdown_table(columns, [
        [str(r["eta"]), r["placement"].split(":")[0], f"{r['steps_per_s']:.3f}",
         f"{r['steps_vs_sync']:.2f}x", f"{r['engine_idle']:.0%}", pct(r["acc_end"]),
         r["to_target"], r["speedup"]] for r in report_rows(rec["runs"], target)], rec)


def chain_lr_table(name: str, targets: tuple[float, ...] = (0.35, 0.40, 0.45)
                   ) -> Callable[[], str]:
    """bench_async.py on the chain job at one learning rate: per (eta, placement), the mean over
    seeds, and the time to each target with its speedup against the synchronous loop."""
    def table() -> str:
        from async_real import report_rows

        rec = record(name)
        per_target = [report_rows(rec["runs"], t) for t in targets]
        rows = []
        for k, r in enumerate(per_target[0]):
            vs = "" if r["speedup"] == "1.00x" else f" ({r['steps_vs_sync']:.2f}x)"
            times = [rows_t[k]["to_target"] if rows_t[k]["speedup"] == "1.00x"
                     else f"{rows_t[k]['to_target'][:-1]}, {rows_t[k]['speedup']})"
                     for rows_t in per_target]  # "26 s (3/3, 0.97x)": seeds that got there
            rows.append([str(r["eta"]), r["placement"].split(":")[0],
                         f"{r['steps_per_s']:.3f}{vs}", f"{r['gen_tokens_per_s']:,.0f}",
                         pct(r["engine_idle"]), pct(r["acc_end"]), *times])
        columns = ["eta", "placement", "steps/s", "gen tok/s", "engine idle", "end",
                   *(f"to {t:.0%}" for t in targets)]
        return markdown_table(columns, rows, rec)
    return table


def vs_trl_table() -> str:
    """bench_vs_trl.py: asyncrl and each TRL learning rate: speed, uniform groups, accuracy, and
    the training seconds to the first evaluation at 80% and at 85%."""
    rec = record("bench_vs_trl.json")
    best_trl = max((r for r in rec["runs"] if r["name"] == "trl"),
                   key=lambda r: max(acc for *_, acc in r["curve"]))
    rows = []
    for r in rec["runs"]:
        accs = [acc for *_, acc in r["curve"]]
        reach = [next((f"{t:.0f} s" for _, t, acc in r["curve"] if acc >= target), "-")
                 for target in (0.80, 0.85)]
        name = "TRL GRPOTrainer" if r["name"] == "trl" else r["name"]
        rows.append([name + (" (best)" if r is best_trl else ""), f"{r['lr']:g}", str(r["steps"]),
                     f"{r['steps_per_s']:.2f}", f"{r['tokens_per_s']:,.0f}",
                     pct(r.get("uniform_groups")), pct(accs[0]), pct(max(accs)), pct(accs[-1]),
                     *reach])
    return markdown_table(("run", "lr", "steps", "steps/s", "tokens/s", "uniform groups",
                           "start", "best", "end", "to 80%", "to 85%"), rows, rec)


TABLES: dict[str, Callable[[], str]] = {
    "vs-trl": vs_trl_table,
    "staleness-main-tuned": staleness_table("staleness_ablation_main.json", runs=False),
    "staleness-main-job": staleness_table("staleness_ablation_main.json", runs=True),
    "chain-async-current": chain_lr_table("bench_async_chain.json", targets=(0.5, 0.7, 0.8)),
    "chain-async-split": chain_lr_table("bench_async_chain_split.json", targets=(0.5, 0.7, 0.8)),
    "chain-async-lr1e-4": chain_lr_table("bench_async_real_lr1e-4.json"),
    "chain-async-lr5e-5": chain_lr_table("bench_async_real_lr5e-5.json"),
    "chain-async": chain_async_table,
    "load-tools": load_table,
    "staleness-tuned": staleness_table("staleness_ablation_chain.json", runs=False),
    "staleness-runs": staleness_table("staleness_ablation_chain.json", runs=True),
    "engine-vs-servers": engine_vs_servers_table,
    "vlm-engine": vlm_engine_table,
    "engine-archs": archs_table("bench_engine_archs.json"),
    "engine-archs-moe": archs_table("bench_engine_archs_moe.json"),
    "main-job": seeds_table("main_job.json"),
    "main-job-lr": staleness_table("main_job_lr.json", runs=True),
    "vlm-job": seeds_table("vlm_job.json"),
    "tool-asynchrony": tools_table,
    "moe-job": moe_table,
    "moe-job-lr": staleness_table("moe_job_lr.json", runs=True),
}


def render(page: str) -> str:
    def body(match: re.Match) -> str:
        name = match["name"]
        if name not in TABLES:
            raise SystemExit(f"unknown generated table {name!r}; known: {sorted(TABLES)}")
        # a table inside a list item keeps the item's indentation, and a blank line after the
        # marker (without it Python-Markdown reads the table as part of the comment's block)
        indent = match["indent"]
        body = "".join(indent + line if line.strip() else line
                       for line in TABLES[name]().splitlines(keepends=True))
        body = "\n" + body if indent else body
        return indent + match[2] + body + match[5]
    return BLOCK.sub(body, page)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="write nothing; exit 1 if a page's generated table is out of date")
    args = ap.parse_args()
    stale, shown = [], set()
    for path in sorted(DOCS.glob("*.md")):
        text = path.read_text()
        shown |= {m["name"] for m in BLOCK.finditer(text)}
        new = render(text)
        if new != text:
            stale.append(path.relative_to(ROOT))
            if not args.check:
                path.write_text(new)
    if unshown := sorted(set(TABLES) - shown):
        raise SystemExit(f"tables no results page shows (add <!-- generated: NAME --> blocks or "
                         f"delete them from TABLES): {', '.join(unshown)}")
    if args.check and stale:
        raise SystemExit(f"out of date (run python benchmarks/results_pages.py): "
                         f"{', '.join(map(str, stale))}")
    print(("updated: " + ", ".join(map(str, stale))) if stale else "every results page is up "
          "to date")


if __name__ == "__main__":
    main()
