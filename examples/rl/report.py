"""Reward curve (PNG, drawn with Pillow: no plotting library needed), per-step CSV and a short
Markdown report for `examples/train_grpo.py`; also `python examples/rl/report.py RUN_DIR...`
to redraw a combined plot of several runs (e.g. DAPO off and on) into examples/rl/results/.
"""
from __future__ import annotations

import csv
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any, Sequence


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def parse_cell(v: str) -> Any:
    """A steps.csv cell back to int / float / bool / str."""
    if v in ("True", "False"):
        return v == "True"
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return v


def window_stats(rewards: Sequence[float], k: int = 5) -> dict[str, float]:
    """First-k and last-k step means, and the noise of a k-step mean at the start: the standard
    deviation of the first k per-step means divided by sqrt(k)."""
    first, last = list(rewards[:k]), list(rewards[-k:])
    sd = statistics.stdev(first) if len(first) > 1 else float("nan")
    return {"first": statistics.fmean(first), "last": statistics.fmean(last),
            "gain": statistics.fmean(last) - statistics.fmean(first),
            "first_step_sd": sd, "first_mean_se": sd / math.sqrt(len(first)) if len(first) > 1 else float("nan")}


def plot(path: Path, series: dict[str, list[tuple[float, float]]], *, title: str, xlabel: str = "step",
         ylabel: str = "mean reward") -> None:
    """Line plot of one or more (x, y) series with y in [0, 1]."""
    from PIL import Image, ImageDraw

    W, H, L, R, T, B = 800, 480, 70, 20, 40, 60
    img = Image.new("RGB", (W, H), "white")
    d = ImageDraw.Draw(img)
    xs = [x for pts in series.values() for x, _ in pts] or [0, 1]
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1

    def px(x: float, y: float) -> tuple[float, float]:
        return L + (x - x0) / (x1 - x0) * (W - L - R), H - B - y * (H - T - B)

    for i in range(6):  # y grid 0, 0.2, … 1.0
        y = i / 5
        _, yy = px(x0, y)
        d.line([(L, yy), (W - R, yy)], fill=(225, 225, 225))
        d.text((L - 35, yy - 6), f"{y:.1f}", fill="black")
    step = max(1, round((x1 - x0) / 10))
    x = math.ceil(x0)
    while x <= x1:
        xx, _ = px(x, 0)
        d.line([(xx, H - B), (xx, H - B + 5)], fill="black")
        d.text((xx - 6, H - B + 8), f"{x:g}", fill="black")
        x += step
    d.rectangle([L, T, W - R, H - B], outline="black")
    d.text((W // 2 - 4 * len(title), 12), title, fill="black")
    d.text((W // 2 - 4 * len(xlabel), H - 25), xlabel, fill="black")
    d.text((8, T - 20), ylabel, fill="black")
    colours = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189)]
    for n, (label, pts) in enumerate(series.items()):
        c = colours[n % len(colours)]
        pts = [p for p in pts if not math.isnan(p[1])]
        if len(pts) > 1:
            d.line([px(*p) for p in pts], fill=c, width=2)
        for p in pts:
            xx, yy = px(*p)
            d.ellipse([xx - 3, yy - 3, xx + 3, yy + 3], fill=c)
        d.line([(L + 15, T + 15 + 18 * n), (L + 40, T + 15 + 18 * n)], fill=c, width=3)
        d.text((L + 46, T + 9 + 18 * n), label, fill="black")
    img.save(path)


def write_report(out: Path, s: dict[str, Any]) -> None:
    steps = s["steps"]
    rewards = [r["reward_mean"] for r in steps]
    mode = s.get("trainer") or ("DAPO on" if s["dapo"] else "DAPO off")  # e.g. trl.GRPOTrainer (examples/trl)
    plot(out / "reward.png", {"mean reward per step (all settled groups)": [(r["step"], r["reward_mean"]) for r in steps],
                              "fraction of informative groups": [(r["step"], r["informative_frac"]) for r in steps]},
         title=f"{s['name']}: SmolLM2-135M, single-digit addition, {mode}")
    w = window_stats(rewards) if len(rewards) >= 2 else {}
    def join(key: str, fmt: str = "{}") -> str:
        return ", ".join(fmt.format(r[key]) for r in steps)

    mean = lambda key: statistics.fmean(r[key] for r in steps) if steps else float("nan")  # noqa: E731
    lines = [
        f"# {s['name']} ({mode})",
        "",
        f"Started {s['started']}; model {s['model']} (fp32 in vLLM and in the trainer); "
        f"{s['groups']} groups × {s['samples']} samples per step, ≤{s['max_tokens']} tokens per reply, "
        f"AdamW lr {s['lr']}, clip {s['clip']}. Load average (2 cores) {s['load_before']:.1f} at the start, "
        f"{s['load_after']:.1f} at the end; per step in `steps.csv` (`load`).",
        "",
        f"- steps: {len(steps)} in {s['train_seconds'] / 60:.1f} min (policy versions 0 → {s['final_version']})",
        f"- seconds per step (mean): rollout {mean('rollout_s'):.1f}, train {mean('train_s'):.1f}, "
        f"sync {mean('sync_s'):.1f} (save {mean('save_s'):.1f} + announce/pause/reload/resume; paused "
        f"{mean('paused_s'):.2f})",
    ]
    if w:
        lines.append(f"- mean reward: first 5 steps {w['first']:.3f}, last 5 steps {w['last']:.3f} (gain "
                     f"{w['gain']:+.3f}); per-step sd over the first 5 steps {w['first_step_sd']:.3f}, so a 5-step "
                     f"mean is known to ±{w['first_mean_se']:.3f} (1 sd)")
    lines += [
        f"- informative groups: {sum(r['groups_informative'] for r in steps)} of "
        f"{sum(r['groups_settled'] for r in steps)} settled ({join('informative_frac', '{:.2f}')})",
        f"- tokens trained: {sum(r['tokens_trained'] for r in steps)} "
        f"({join('tokens_trained')})",
        f"- surplus rollouts cancelled on the daemons once the batch was full (DAPO): {sum(r['cancelled_rollouts'] for r in steps)} "
        f"({join('cancelled_rollouts')}); groups opened "
        f"{sum(r['opened_groups'] for r in steps)}",
        f"- trained samples whose policyVersion differed from the trainer's: "
        f"{sum(r['stale_samples'] for r in steps)}; every backend reloaded every version: "
        f"{all(r['reloaded'] for r in steps)}",
        f"- trainer vs vLLM logprob of the trained tokens: max |Δ| {max(r['logprob_diff_max'] for r in steps):.1e}; "
        f"importance ratios within [{min(r['ratio_min'] for r in steps):.5f}, {max(r['ratio_max'] for r in steps):.5f}]",
        f"- reply length (tokens, mean per step): {join('reply_tokens_mean')}",
    ]
    for key, label in (("heldout_before", "before training"), ("heldout_after", f"after (version {s['final_version']})")):
        h = s.get(key)
        if h:
            lines.append(f"- held-out reward {label}: {h['mean']:.3f} ({h['rollouts']} rollouts over {h['prompts']} "
                         f"prompts never trained on; replies {h['mean_reply_tokens']:.0f} tokens)")
    lines += ["", "Per step: `steps.csv`; curve: `reward.png`; everything: `summary.json`.", ""]
    (out / "report.md").write_text("\n".join(lines))


def combined(dirs: Sequence[Path], out: Path) -> None:
    series = {}
    for d in dirs:
        s = json.loads((d / "summary.json").read_text())
        series[f"{s['name']} ({'DAPO on' if s['dapo'] else 'DAPO off'})"] = [(r["step"], r["reward_mean"])
                                                                            for r in s["steps"]]
    plot(out, series, title="SmolLM2-135M through rolloutd: mean reward per step")


if __name__ == "__main__":
    dirs = [Path(a) for a in sys.argv[1:]]
    combined(dirs, dirs[0].parent / "reward-combined.png")
