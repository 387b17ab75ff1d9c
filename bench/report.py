"""docs/results.md, generated from the raw results under docs/results/: one row per benchmark target.

Usage (from the repository root; a second, no Ray, no torch)::

    python bench/report.py            # write docs/results.md and the README's results line
    python bench/report.py --check    # exit 1 if either differs from what the files give (CI runs this)

Each ``Target`` names its benchmark, what it aims at, the command that produced its result
(where the run did not record its own ``argv``), a glob of files under ``docs/results/``
(``docs/results/archive/`` is never read) and how its result reads from the file's JSON
lines (``read``). Of the files a glob matches, the newest is the latest result: by the date
the run recorded (``date`` or ``machine.date``), else the date in the file name. Nothing on
the page is typed by hand: every figure, date and machine comes from a file, so a new run
(``--out docs/results/NAME_DATE.jsonl``) changes the page and CI fails until
``python bench/report.py`` is run and both are committed.

What this file does not own: the benchmarks (``bench/*.py``) and what their keys mean
(docs/benchmarks.md explains each).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import glob
import json
import re
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "results"
PAGE = REPO / "docs" / "results.md"
README = REPO / "README.md"
README_PREFIX = "**Latest results**"
"""The README line that carries the headline figures starts with this (``readme_line``)."""

Lines = list[dict]
Reading = tuple[str, str]
"""(result, met): the figures of a run, and whether its target is met ('yes', 'no' or '-': no target)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Target:
    """One row of docs/results.md."""

    bench: str
    """The script under bench/, without ``.py``."""
    target: str
    """What the benchmark aims at, in words (the number a run is judged by, where it has one)."""
    pattern: str
    """Glob of result files under docs/results/."""
    read: Callable[[Lines], Reading] | None = None
    """The result and whether it meets the target, from the file's JSON lines; None: no raw result kept."""
    command: str = ""
    """The command, where the run did not record its argv (default ``python bench/BENCH.py``)."""


def _yes(ok: bool) -> str:
    return "yes" if ok else "no"


def _summary(lines: Lines) -> dict:
    return next(line for line in reversed(lines) if line.get("summary"))


def read_vs_pytorch(lines: Lines) -> Reading:
    s = _summary(lines)
    ratios = ", ".join(f"{w} {'none (does not fit)' if r is None else r}" for w, r in s["auto_over_best_peer"].items())
    return f"best peer / alpa-torch: {ratios}", _yes(s["target_met"])


def read_fidelity(lines: Lines) -> Reading:
    s = _summary(lines)
    t, met = s["targets"], s["met"]
    text = (f"{s['measured']} plans: Spearman {s['spearman']:.3g} (≥ {t['spearman']}), step error "
            f"{s['median_rel_err_time']:.1%} (≤ {t['median_rel_err_time']:.0%}), peak-memory error "
            f"{s['median_rel_err_mem']:.1%} (≤ {t['median_rel_err_mem']:.0%}; live heap "
            f"{s['median_rel_err_mem_live']:.1%})")
    return text, f"{sum(met.values())} of {len(met)}"


def read_plan_targets(lines: Lines) -> Reading:
    cases = [line for line in lines if "case" in line]
    text = ", ".join(f"{c['case']} {c['wall_s']} s (≤ {c['target_s']:g})" for c in cases)
    return f"planning wall time: {text}", _yes(all(c["met"] for c in cases))


def read_plan_zoo(lines: Lines) -> Reading:
    counts: dict[str, int] = {}
    for line in lines:
        counts[line["status"]] = counts.get(line["status"], 0) + 1
    planned = [line for line in lines if line["status"] == "ok"]
    over = [line for line in planned if line["peak_memory_gib"] > line["device_memory_gib"]]
    worst = max(planned, key=lambda line: line["peak_memory_gib"] / line["device_memory_gib"])
    text = (", ".join(f"{n} {status}" for status, n in sorted(counts.items())) + f" of {len(lines)} (model, cluster); "
            f"largest peak {worst['peak_memory_gib']} of {worst['device_memory_gib']:g} GiB ({worst['model']})")
    return text, _yes(not over and counts.get("ok", 0) + counts.get("skipped", 0) == len(lines))


def read_driver_memory(lines: Lines) -> Reading:
    s = _summary(lines)
    low, high = s["params_range"]
    share = "–".join(f"{x:g}" for x in s["worker_state_share_range"])
    text = (f"driver peak {s['driver_peak_growth']:+.2%} from {low / 1e6:.1f} M to {high / 1e6:.1f} M parameters "
            f"(≤ {s['target_driver_peak_growth']:.0%}); each of 4 workers holds {share} of the state")
    return text, _yes(s["driver_peak_growth"] <= s["target_driver_peak_growth"])


def read_runner_overhead(lines: Lines) -> Reading:
    last = lines[-1]
    return (f"{last['runner_step_ms']} ms a step against eager {last['eager_step_ms']} ms: "
            f"{last['overhead_us_per_op']} µs per operator ({last['program_steps']} operators)", "-")


def read_step_gap(lines: Lines) -> Reading:
    s = _summary(lines)["summary"]
    early, end = s["early_answer"], s["answer_at_end"]
    return (f"early answer {early['step_ms']} ms a step, {early['idle_between_steps_ms']} ms idle between steps; "
            f"answer at the end {end['step_ms']} ms, {end['idle_between_steps_ms']} ms idle", "-")


def read_model_reads(lines: Lines) -> Reading:
    s = _summary(lines)
    spread = max(s["round_spread"].values())
    text = (f"never reads {s['never_reads_ms']} ms an iteration, hooks removed {s['hooks_removed_ms']} ms "
            f"(ratio {s['never_reads_over_hooks_removed']}, rounds' spread up to {spread}), "
            f"reads every step {s['reads_every_step_ms']} ms")
    return text, _yes(s["never_reads_over_hooks_removed"] <= spread)


def read_gpu_step(lines: Lines) -> Reading:
    last = lines[-1]
    worst = max(last["loss_abs_diff"])
    return (f"{last['params_M']} M parameters: {last['parallelize_step_ms']} ms a step against eager "
            f"{last['eager_step_ms']} ms ({last['parallelize_over_eager']}x); losses within {worst:.2g}", "-")


def read_one_device(lines: Lines) -> Reading:
    at = [line for line in lines if line.get("summary") and "met" in line]
    text = "; ".join(f"{s['workload']} T={s['seq_len']}: step {s['step_over_eager']}x, peak {s['peak_over_eager']}x "
                     f"eager" for s in at)
    return f"parallelize / eager, one device: {text}", _yes(bool(at) and all(s["met"] for s in at))


def read_schedules(lines: Lines) -> Reading:
    rows = {(r["schedule"], r["microbatches"]): r for r in lines if not r.get("summary")}
    summary = _summary(lines)
    zb, ofob = rows.get(("zb-h1", 4)), rows.get(("1f1b", 4))
    halved = zb is not None and ofob is not None and zb["measured_bubble"] <= ofob["measured_bubble"] / 2
    slowest = min(summary["alpa_over_torch"].items(), key=lambda kv: kv[1])
    text = (f"largest bubble gap {summary['max_bubble_gap']} (≤ 0.15); PyTorch / alpa-torch step from "
            f"{slowest[1]} ({slowest[0]}) to {max(summary['alpa_over_torch'].values())} (≥ 1.0)")
    if zb is not None and ofob is not None:
        text += f"; measured bubble at 4: zb-h1 {zb['measured_bubble']}, 1f1b {ofob['measured_bubble']}"
    return text, _yes(bool(summary.get("met")) and halved)


TARGETS = (
    Target(bench="vs_pytorch",
           target="best of DDP, FSDP2, FSDP2+TP, torch pipelines, compiled or eager / alpa-torch ≥ 1.0, each workload",
           pattern="vs_pytorch_*.jsonl", read=read_vs_pytorch),
    Target(bench="fidelity", target="1x2, cost model alone: predicted vs measured step and memory",
           pattern="fidelity_1x2_*.jsonl", read=read_fidelity, command="python bench/fidelity.py --cluster 1x2"),
    Target(bench="fidelity", target="2x2, after one calibration: predicted vs measured step and memory",
           pattern="fidelity_2x2_*_calibrated.jsonl", read=read_fidelity,
           command="python bench/fidelity.py --fit-calibration cal.json; "
                   "python bench/fidelity.py --calibration cal.json"),
    Target(bench="plan_targets", target="`alpa-torch plan` wall time for LLaMA-3-8B, GPT-3 39B, LLaMA-3-70B",
           pattern="plan_targets_*.jsonl", read=read_plan_targets),
    Target(bench="plan_zoo", target="every published HF model planned on every cluster within device memory",
           pattern="plan_zoo_*.jsonl", read=read_plan_zoo),
    Target(bench="driver_memory", target="driver peak RSS growth as the model grows 17x",
           pattern="driver_memory_2*.jsonl", read=read_driver_memory),
    Target(bench="model_reads", target="a loop that never reads the model keeps its step time",
           pattern="model_reads_*.jsonl", read=read_model_reads),
    Target(bench="step_gap", target="the driver's round trip between steps (1x1)", pattern="step_gap_*_1x1.jsonl",
           read=read_step_gap),
    Target(bench="step_gap", target="the driver's round trip between steps (1x2)", pattern="step_gap_*_1x2.jsonl",
           read=read_step_gap),
    Target(bench="runner_overhead", target="the runtime's own cost per operator, one device",
           pattern="runner_overhead_*.jsonl", read=read_runner_overhead),
    Target(bench="gpu_step", target="one CUDA device: parallelize against eager", pattern="gpu_step_*.jsonl",
           read=read_gpu_step),
    Target(bench="auto_vs_manual", target="automatic plan ≥ 0.95 x the best manual plan, 4 cases", pattern=""),
    Target(bench="runtime_vs_torch", target="runtime ≤ 1.10 x hand-written PyTorch, forced plans", pattern=""),
    Target(bench="peers", target="automatic plan against PyTorch's parallelisms, one run", pattern=""),
    Target(bench="one_device", target="T = 4096: parallelize's peak ≤ 1.15x and step ≤ 1.05x eager's",
           pattern="one_device_*.jsonl", read=read_one_device),
    Target(bench="schedules", target="1x2: predicted bubble within 15 % of measured, each schedule ≥ PyTorch's, "
                                     "zb-h1's bubble ≤ half of 1f1b's at 4 microbatches",
           pattern="schedules_*.jsonl", read=read_schedules),
    Target(bench="plan_gpt", target="automatic plan never slower than the best manual plan", pattern=""),
    Target(bench="ilp", target="sharding ILP size and solve time, GPT-3 as one stage", pattern=""),
    Target(bench="stage_dp_kernels", target="stage DP time on synthetic cost tensors", pattern=""),
    Target(bench="dp_breakdown", target="where the data-parallel plan's step goes (diagnostic)", pattern=""),
)


def load(path: Path) -> Lines:
    """The JSON lines of a result file (a single JSON object counts as one line)."""
    text = path.read_text()
    if path.suffix == ".json":
        return [json.loads(text)]
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _machine(line: dict) -> dict:
    return line["machine"] if isinstance(line.get("machine"), dict) else line


def recorded_date(path: Path, lines: Lines) -> str:
    """The last date the run recorded (ISO), else the file name's date."""
    dates = [_machine(line)["date"] for line in lines if "date" in _machine(line)]
    if dates:
        return dates[-1]
    found = re.search(r"\d{4}-\d{2}-\d{2}", path.name)
    return found.group(0) if found else ""


def latest(target: Target) -> Path | None:
    """The newest file under docs/results/ (not its archive) that the target's glob matches."""
    if not target.pattern:
        return None
    paths = [Path(p) for p in sorted(glob.glob(str(RESULTS / target.pattern)))]
    return max(paths, key=lambda p: recorded_date(p, load(p)), default=None)


def when(path: Path, lines: Lines) -> str:
    """'2026-11-27 19:10 UTC, code dd26f18+': the run's date and the commit it ran."""
    date = recorded_date(path, lines)
    text = date[:10] + (f" {date[11:16]} UTC" if len(date) > 10 else "")
    commits = [_machine(line)["commit"] for line in lines if _machine(line).get("commit")]
    return text + (f", code {commits[-1]}" if commits else "")


def machine(lines: Lines) -> str:
    """The machine as the run recorded it: GPU, cores, torch, the 1-minute load over the run."""
    described = [line for line in lines if "cpus" in _machine(line)]
    if not described:
        return "not recorded"
    m = _machine(described[-1])
    loads = sorted(_machine(line)["load_1_5_15"][0] for line in described if "load_1_5_15" in _machine(line))
    gpu = next((line["device"] for line in lines if "machine" in line and isinstance(line.get("device"), str)), None)
    parts = [gpu] if gpu else []
    parts += [f"{m['cpus']} cores", f"torch {m['torch']}"]
    if loads:
        parts.append(f"load {loads[0]:g}" + (f"–{loads[-1]:g}" if loads[-1] != loads[0] else ""))
    return ", ".join(parts)


def command(target: Target, lines: Lines) -> str:
    """The command the run recorded (``argv`` of its first line), else the target's."""
    argv = next((line["argv"] for line in lines if "argv" in line), None)
    if argv is not None:
        return shlex.join(["python", f"bench/{target.bench}.py", *argv])
    return target.command or f"python bench/{target.bench}.py"


def row(target: Target) -> str:
    path = latest(target)
    if path is None or target.read is None:
        raise FileNotFoundError(f"no file under {RESULTS} matches {target.pattern!r} ({target.bench})")
    lines = load(path)
    result, met = target.read(lines)
    raw = f"[{path.name}](results/{path.name})"
    cells = [f"`{target.bench}`", target.target, result, met, when(path, lines), machine(lines),
             f"`{command(target, lines)}`", raw]
    return "| " + " | ".join(cells) + " |"


def headline() -> str:
    """The README's one line: the headline figures, read from the same files as the page."""
    peers = _summary(load(latest(TARGETS[0])))
    measured = {w: r for w, r in peers["auto_over_best_peer"].items() if r is not None}
    ratios = list(measured.values())
    plans = [line for line in load(latest(TARGETS[3])) if "case" in line]
    slowest = max(plans, key=lambda c: c["wall_s"])
    gpu = load(latest(TARGETS[10]))[-1]
    workloads = "–".join(f"{r:g}" for r in sorted({min(ratios), max(ratios)})) + (
        f" on {len(ratios)} CPU workloads" if len(ratios) > 1 else f" on {next(iter(measured))}")
    return (f"{README_PREFIX} ([docs/results.md](docs/results.md), generated from the raw JSON): best PyTorch peer "
            f"(compiled or eager) / alpa-torch {workloads} (target ≥ 1.0, "
            f"{'met' if peers['target_met'] else 'not met'}); `alpa-torch plan` of {slowest['case']} in "
            f"{slowest['wall_s']} s (target ≤ {slowest['target_s']:g} s); on one H100, "
            f"{gpu['parallelize_over_eager']}x eager's step time.")


HEADER = """# Results

The latest result of every benchmark target, one row each, generated by `python bench/report.py`
from the raw files beside this page ([results/](results/)); CI runs `python bench/report.py --check`
and fails when this page and the files differ. What each benchmark measures, how to run it
and how to read it, and the limits of the machine the CPU timings come from:
[benchmarks.md](benchmarks.md). Older runs: [results/archive/](results/archive/README.md).
"""


def page() -> str:
    measured = [t for t in TARGETS if t.read is not None]
    missing = [t for t in TARGETS if t.read is None]
    lines = [HEADER, "| benchmark | target | latest result | met | date | machine | command | raw |",
             "|---|---|---|---|---|---|---|---|", *(row(t) for t in measured), "",
             "No raw result in the repository yet (run the command; it prints JSON lines, `--out FILE` where "
             "the script has it):", "", "| benchmark | target | command |", "|---|---|---|",
             *(f"| `{t.bench}` | {t.target} | `{t.command or f'python bench/{t.bench}.py'}` |" for t in missing)]
    return "\n".join(lines) + "\n"


def with_headline(readme: str) -> str:
    """The README with its results line (the line starting with ``README_PREFIX``) regenerated."""
    lines = readme.splitlines(keepends=True)
    at = [i for i, line in enumerate(lines) if line.startswith(README_PREFIX)]
    if len(at) != 1:
        raise ValueError(f"README.md must have exactly one line starting with {README_PREFIX!r} (found {len(at)})")
    lines[at[0]] = headline() + "\n"
    return "".join(lines)


def _differs(path: Path, want: str) -> bool:
    have = path.read_text() if path.exists() else ""
    if have == want:
        return False
    diff = difflib.unified_diff(have.splitlines(), want.splitlines(), f"{path.name} (committed)",
                                f"{path.name} (from docs/results/)", lineterm="", n=0)
    print("\n".join(diff), file=sys.stderr)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/results.md or the README's line is stale")
    args = ap.parse_args(argv)
    want_page, want_readme = page(), with_headline(README.read_text())
    if args.check:
        stale = [p.relative_to(REPO) for p, want in ((PAGE, want_page), (README, want_readme)) if _differs(p, want)]
        if stale:
            print(f"stale: {', '.join(map(str, stale))}. Fix: python bench/report.py, then commit both",
                  file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(want_page)
    README.write_text(want_readme)
    return 0


if __name__ == "__main__":
    sys.exit(main())
