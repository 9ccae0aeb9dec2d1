"""Speculative decoding, the scheduler's side: how many draft tokens each request may verify
this step, and the acceptance metrics. Plain Python; the proposals come from the runner.

Depth adapts per request to its running acceptance: with a per-token acceptance rate a, the
j-th draft is kept with probability about a**j, so drafts are verified only while that beats
their cost (a**j > `SpecConfig.draft_cost`, the price of one more query token relative to a
decode step: small on a GPU, large on a CPU). A request whose acceptance earns no draft still
verifies one every PROBE_EVERY steps, so a rate that recovers is noticed. A step whose batch is
already large is compute-bound: extra query tokens cost about as much as the tokens they might
save, so it does not speculate.
"""

from __future__ import annotations

from skyline.config import SpecConfig

DECAY = 0.8  # weight of the past in the running acceptance
PRIOR = (1.0, 2.0)  # (accepted, tried) pseudo-counts: a new request starts at rate 0.5
PROBE_EVERY = 8


class SpecPolicy:
    def __init__(self, cfg: SpecConfig) -> None:
        self.cfg = cfg
        self._rate: dict[str, tuple[float, float]] = {}  # req id -> decayed (accepted, tried)
        self._idle: dict[str, int] = {}  # req id -> steps since its last verification
        self.num_steps = 0  # verifications: (request, step) pairs with drafts
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        k = cfg.num_speculative_tokens
        self.accepted_by_pos = [0] * k
        self.drafted_by_pos = [0] * k

    def enabled(self, num_batch_tokens: int) -> bool:
        """Whether a step whose batch holds `num_batch_tokens` tokens before drafts speculates."""
        return num_batch_tokens <= self.cfg.max_batch_tokens

    def depth(self, req_id: str) -> int:
        """How many drafts the request may verify now (0: decode plainly this step)."""
        acc, tried = self._rate.get(req_id, PRIOR)
        rate = acc / tried
        depth, gain = 0, rate
        while depth < self.cfg.num_speculative_tokens and gain > self.cfg.draft_cost:
            depth += 1
            gain *= rate
        if depth == 0:
            idle = self._idle.get(req_id, 0) + 1
            self._idle[req_id] = idle
            if idle >= PROBE_EVERY:
                depth = 1
        return depth

    def observe(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        """A verification of `num_drafts` drafts kept the first `num_accepted`."""
        self._idle.pop(req_id, None)
        acc, tried = self._rate.get(req_id, PRIOR)
        # Drafts after the first rejection were never really tried.
        tried_now = num_accepted + (num_accepted < num_drafts)
        self._rate[req_id] = (DECAY * acc + num_accepted, DECAY * tried + tried_now)
        self.num_steps += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for j in range(num_drafts):
            self.drafted_by_pos[j] += 1
            self.accepted_by_pos[j] += j < num_accepted

    def forget(self, req_id: str) -> None:
        self._rate.pop(req_id, None)
        self._idle.pop(req_id, None)

    def stats(self) -> dict[str, float]:
        s = {
            "spec_num_verifications": self.num_steps,
            "spec_num_draft_tokens": self.num_draft_tokens,
            "spec_num_accepted_tokens": self.num_accepted_tokens,
            "spec_acceptance_rate": _ratio(self.num_accepted_tokens, self.num_draft_tokens),
            # tokens emitted per verification: the accepted drafts and the target's own token
            "spec_mean_accepted_length": (
                1.0 + self.num_accepted_tokens / self.num_steps if self.num_steps else 0.0
            ),
        }
        for j, (a, d) in enumerate(zip(self.accepted_by_pos, self.drafted_by_pos, strict=True)):
            s[f"spec_acceptance_pos_{j}"] = _ratio(a, d)
        return s


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0
