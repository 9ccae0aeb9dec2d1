"""The prompts of the speculative-decoding benchmarks (bench/spec_decode.py, bench/spec_gate.py):
code editing, whose answer mostly repeats the prompt, and chat; and the warm-up before timing.
The CHAT prompts are not in the EAGLE head's training set (skyline/tools/prompts.jsonl)."""

from __future__ import annotations

from skyline.engine.frontend.llm import LLM
from skyline.types import SamplingParams

SNIPPETS = [
    '''def summarize_orders(orders, tax_rate, currency="EUR"):
    """Group orders by customer and compute totals with tax."""
    totals = {}
    counts = {}
    for order in orders:
        customer = order["customer"]
        amount = order["amount"]
        if amount <= 0:
            continue
        if customer not in totals:
            totals[customer] = 0.0
            counts[customer] = 0
        totals[customer] += amount
        counts[customer] += 1
    report = []
    for customer, total in sorted(totals.items()):
        taxed = total * (1 + tax_rate)
        average = total / counts[customer]
        line = {
            "customer": customer,
            "orders": counts[customer],
            "total": round(total, 2),
            "taxed": round(taxed, 2),
            "average": round(average, 2),
            "currency": currency,
        }
        report.append(line)
    grand_total = sum(item["taxed"] for item in report)
    largest = max(report, key=lambda item: item["taxed"]) if report else None
    summary = {
        "customers": len(report),
        "grand_total": round(grand_total, 2),
        "largest": largest["customer"] if largest else None,
        "currency": currency,
    }
    return report, summary
''',
    '''def parse_log_lines(lines, min_level="INFO"):
    """Parse log lines into records and count them by level."""
    levels = ["DEBUG", "INFO", "WARNING", "ERROR"]
    threshold = levels.index(min_level)
    records = []
    counts = {level: 0 for level in levels}
    for raw in lines:
        raw = raw.strip()
        if not raw or raw.startswith("#"):
            continue
        parts = raw.split(" ", 3)
        if len(parts) < 4:
            continue
        date, clock, level, message = parts
        if level not in levels:
            continue
        if levels.index(level) < threshold:
            continue
        counts[level] += 1
        record = {
            "date": date,
            "time": clock,
            "level": level,
            "message": message,
        }
        records.append(record)
    errors = [r for r in records if r["level"] == "ERROR"]
    first_error = errors[0]["message"] if errors else None
    result = {
        "records": records,
        "counts": counts,
        "first_error": first_error,
        "total": len(records),
    }
    return result
''',
]
RENAMES = [("customer", "client"), ("record", "entry")]

CHAT = [
    "What are three good habits for staying healthy? Answer in a short paragraph.",
    "Explain what a binary search is to a beginner.",
    "Write a short poem about the sea.",
    "Give me a few tips for learning a new language.",
]


def code_prompts(llm: LLM) -> list[list[int]]:
    return [
        llm.render_chat([{"role": "user", "content":
                          f"Rewrite this function with `{a}` renamed to `{b}`. Output only the "
                          f"code.\n\n```python\n{code}```"}])
        for code, (a, b) in zip(SNIPPETS, RENAMES, strict=True)
    ]


def chat_prompts(llm: LLM, n: int) -> list[list[int]]:
    return [llm.render_chat([{"role": "user", "content": CHAT[i % len(CHAT)] + f" ({i})"}])
            for i in range(n)]


def warm_up(llm: LLM, device: str, alone: list[list[int]], together: list[list[int]]) -> None:
    """Before timing. On CUDA, Triton compiles a kernel variant the first time its shape class
    appears (a long prompt's prefill, a verification step of a new batch size), which costs
    far more than the steps of a short run: the workload's prompts run once, speculating in
    every step (the gate set aside, then restored untouched): `alone` one by one, `together`
    as one batch, twice: the second time over cached prefixes, as the timed runs will be (a
    prefill over a cached prefix is a shape class of its own). Every engine then holds the
    same cached prefixes."""
    llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0.0, max_tokens=8))
    if device == "cpu":
        return
    policy = llm.engine.scheduler.spec
    gate = policy.gate if policy is not None else None
    if gate is not None:
        policy.gate = None
    try:
        params = SamplingParams(temperature=0.0, max_tokens=32)
        for _ in range(2):
            for batch in [[p] for p in alone] + ([together] if together else []):
                llm.generate(batch, params)
    finally:
        if gate is not None:
            policy.gate = gate
