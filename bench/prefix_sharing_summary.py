"""The prefix-sharing benchmark's table and what it adds up to (bench/prefix_sharing.py): the
cells, each cell's record of its samples, and the summary against issue 39's targets."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from vericache.errors import InvalidRequestError

CODES = ("before", "after")
MODES = ("vericache", "full_local", "full_remote")
# Which copy of a prefix a mode's requests move on each path: a store read is its full KV;
# over the link VERICACHE sends the compressed KV and FULL_REMOTE the full KV.
PREFIX_BYTES = {
    "store": {"vericache": "full_kv_bytes", "full_local": "full_kv_bytes"},
    "link": {"vericache": "compressed_wire_bytes", "full_remote": "full_wire_bytes"},
}
TARGETS = {
    "bytes_per_request_over_prefix": 1.1,  # at most
    "peak_kv_over_allowance": 1.0,  # at most
    "vericache_gain": 2.0,  # at least, at the most sessions on one prefix
}

DEFINITIONS = {
    "cell": "(code, mode, sessions, prefixes): max(sessions, prefixes) requests over the "
    "prefixes in turn, `sessions` in flight at once, one wave on prefixes new to the server",
    "tokens_per_s": "output tokens of the cell / its wall seconds; the median of the samples, "
    "with tokens_per_s_min and _max",
    "sessions_per_prefix": "requests of the cell / its prefixes",
    "own_tokens": "a request's tokens after its prefix: the rest of its prompt and its output",
    "store_over_prefix": "(store bytes per request) / (the prefix's full KV / sessions per "
    "prefix); a session's own tokens are never read from the store. FULL_REMOTE's requests "
    "report none: the verifier's load of the copy it serves fetches from is not theirs",
    "link_over_prefix": "(link bytes per request - the full KV of its own tokens, which "
    "VERICACHE sends to its drafter each round) / (the prefix's KV on the link: compressed for "
    "VERICACHE, full for FULL_REMOTE / sessions per prefix); FULL_LOCAL moves nothing over it",
    "peak_kv_bytes": "per worker, the most of its sessions' caches (the verifier's: "
    "residency(); before sharing each holds a copy of its prefix) and its copies of the cell's "
    "prefixes, at one reading (every 0.25 s; the verifier's residency peak too); the most of "
    "the samples",
    "kv_allowance_bytes": "per worker, its copies of the cell's prefixes + its sessions at the "
    "peak's reading (the verifier: the cell's sessions, where its peak came from residency()) "
    "x (the most own tokens of a request, + a round's drafts for VERICACHE, which issue 39 counts "
    "among a session's own tokens) x the full KV of one token",
    "peak_kv_over_allowance": "peak_kv_bytes / kv_allowance_bytes, in the sample where it is "
    "the most",
    "peak_kv_bytes_by_code": "peak_kv_bytes at the headline cell, per code, mode and worker",
    "gain": "tokens/s after / before, each sample over the other code's sample of the same "
    "cell served beside it; the median, min and max",
    "identical": "every sample's outputs equal the FULL_LOCAL outputs of the working tree (or "
    "the only code) on the same prefixes and prompts",
}


@dataclass(frozen=True)
class Layout:
    """How a cell's sessions spread over prefixes."""

    num_sessions: int  # requests in flight at once
    num_prefixes: int  # the prefixes they read, in turn

    @property
    def num_requests(self) -> int:
        return max(self.num_sessions, self.num_prefixes)

    @property
    def sessions_per_prefix(self) -> float:
        return self.num_requests / self.num_prefixes

    @property
    def name(self) -> str:
        return f"s={self.num_sessions} p={self.num_prefixes}"


@dataclass(frozen=True)
class SharingSpec:
    """The cells and how they are served (resolved from the arguments)."""

    codes: tuple[str, ...]
    modes: tuple[str, ...]
    session_counts: tuple[int, ...]
    prefix_counts: tuple[int, ...]
    prefix_tokens: tuple[int, int]
    max_tokens: int
    draft_len: int
    repeats: int
    compressor: str
    num_drafters: int
    link_bytes_per_s: float
    prefix_cache_bytes: int
    before_commit: str

    def __post_init__(self):
        counts = (*self.session_counts, *self.prefix_counts, self.max_tokens, self.draft_len)
        if min(*counts, self.repeats, self.num_drafters) < 1:
            raise InvalidRequestError(f"counts must be >= 1: {self}")
        for counts in (self.session_counts, self.prefix_counts):
            if len(set(counts)) < len(counts):
                raise InvalidRequestError(f"--sessions and --prefixes repeat a count: {counts}")
        if not self.codes or set(self.codes) - set(CODES) or len(set(self.codes)) < len(self.codes):
            raise InvalidRequestError(f"codes are before and/or after, not {self.codes}")
        if set(self.modes) - set(MODES) or "full_local" not in self.modes:
            raise InvalidRequestError(
                f"modes are of {MODES}, full_local among them (the reference): {self.modes}"
            )
        if not self.link_bytes_per_s > 0 or self.prefix_cache_bytes < 1:
            raise InvalidRequestError("--link-mb-s and --prefix-cache-mib must be > 0")

    @property
    def layouts(self) -> tuple[Layout, ...]:
        return tuple(Layout(s, p) for s in self.session_counts for p in self.prefix_counts)

    @property
    def headline(self) -> Layout:
        return Layout(max(self.session_counts), min(self.prefix_counts))

    @property
    def reference_code(self) -> str:
        return "after" if "after" in self.codes else self.codes[0]


# --- Cells ---------------------------------------------------------------------------------------


def cell_records(samples: dict, plans: dict, spec: SharingSpec) -> list[dict]:
    """A record per (code, mode, layout), from its samples (the host's replies, in repeat
    order); outputs are checked against FULL_LOCAL's, then dropped."""
    records = []
    for (code, mode, layout), replies in samples.items():
        reference = samples[(spec.reference_code, "full_local", layout)][0]["outputs"]
        plan = plans[layout]
        cell_samples = [r["sample"] for r in replies]
        record = _cell(code, mode, layout, cell_samples, plan, spec.draft_len)
        record["outputs_match"] = [reply["outputs"] == reference for reply in replies]
        records.append(record)
    return records


def _cell(
    code: str, mode: str, layout: Layout, samples: list[dict], plan: dict, draft_len: int
) -> dict:
    prefixes = plan["prefixes"][code]
    token_bytes = statistics.mean(p["full_kv_bytes"] / p["num_tokens"] for p in prefixes)
    own = [
        [
            suffix + request["num_tokens"]
            for suffix, request in zip(plan["suffix_tokens"], s["requests"])
        ]
        for s in samples
    ]
    num = layout.num_requests
    store = statistics.median(s["store_bytes"] / num for s in samples)
    link = statistics.median(s["link_bytes"] / num for s in samples)
    own_link = statistics.median(statistics.mean(tokens) for tokens in own) * token_bytes
    rates = [s["tokens_per_s"] for s in samples]
    return {
        "name": f"{code} {mode} {layout.name}",
        "code": code,
        "mode": mode,
        "layout": layout.name,
        "num_sessions": layout.num_sessions,
        "num_prefixes": layout.num_prefixes,
        "num_requests": num,
        "tokens_per_s": statistics.median(rates),
        "tokens_per_s_min": min(rates),
        "tokens_per_s_max": max(rates),
        "store_bytes_per_request": store,
        "link_bytes_per_request": link,
        "own_tokens_per_request": statistics.mean(t for tokens in own for t in tokens),
        "store_over_prefix": _over_prefix(store, 0.0, "store", mode, prefixes, layout),
        "link_over_prefix": _over_prefix(
            link, own_link if mode == "vericache" else 0.0, "link", mode, prefixes, layout
        ),
        "workers": _workers(
            samples,
            max(t for tokens in own for t in tokens) + (draft_len if mode == "vericache" else 0),
            token_bytes,
        ),
        "samples": samples,
    }


def _over_prefix(per_request: float, own: float, path: str, mode: str, prefixes, layout) -> float:
    # A mode that moves no prefix this way is measured against the full KV: 0 where it moves none.
    field = PREFIX_BYTES[path].get(mode, "full_kv_bytes")
    share = statistics.mean(p[field] for p in prefixes) / layout.sessions_per_prefix
    return (per_request - own) / share


def _workers(samples: list[dict], max_own_tokens: int, token_bytes: float) -> dict:
    """Per worker: its peak KV against what issue 39 allows it at that reading, in the sample
    where the peak is the most over it."""
    workers = {}
    for name in samples[0]["workers"]:
        worst = None
        for sample in samples:
            kv = sample["workers"][name]
            own = kv["sessions_at_peak"] * max_own_tokens * token_bytes
            allowance = kv["prefix_kv_bytes"] + own
            ratio = kv["peak_kv_bytes"] / allowance if allowance else None
            if worst is None or (ratio or 0.0) > (worst["peak_kv_over_allowance"] or 0.0):
                worst = {
                    **{k: v for k, v in kv.items() if k != "num_readings"},
                    "kv_allowance_bytes": allowance,
                    "peak_kv_over_allowance": ratio,
                }
        workers[name] = worst
    return workers


# --- Summary -------------------------------------------------------------------------------------


def summarize(cells: list[dict], spec: SharingSpec) -> dict:
    headline = spec.headline
    by_key = {(c["code"], c["mode"], c["layout"]): c for c in cells}
    code = spec.reference_code
    at_headline = {m: by_key[(code, m, headline.name)] for m in spec.modes}
    gains = _gains(by_key, spec)
    vericache_gain = gains.get(f"vericache {headline.name}") if "vericache" in spec.modes else None
    identical = all(all(c["outputs_match"]) for c in cells)
    missed = _missed(cells, code)
    missed_targets = {m["target"] for m in missed}
    summary = {
        "headline_cell": f"{headline.num_sessions} sessions on {headline.num_prefixes} prefix(es)",
        "store_bytes_per_request_over_prefix": {
            m: c["store_over_prefix"] for m, c in at_headline.items()
        },
        "link_bytes_per_request_over_prefix": {
            m: c["link_over_prefix"] for m, c in at_headline.items()
        },
        "peak_kv_over_allowance": {
            m: {w: v["peak_kv_over_allowance"] for w, v in c["workers"].items()}
            for m, c in at_headline.items()
        },
        "peak_kv_bytes_by_code": {
            c: {m: _peaks(by_key[(c, m, headline.name)]) for m in spec.modes} for c in spec.codes
        },
        "vericache_gain_at_32_sessions": vericache_gain["median"] if vericache_gain else None,
        "vericache_gain_at_32_sessions_range": (
            [vericache_gain["min"], vericache_gain["max"]] if vericache_gain else None
        ),
        "gain_by_cell": gains,
        "tokens_per_s_by_cell": {c["name"]: c["tokens_per_s"] for c in cells},
        "identical": identical,
        "missed": missed,
    }
    summary["meets_targets"] = {
        "store_bytes_per_request": "store_bytes_per_request" not in missed_targets,
        "link_bytes_per_request": "link_bytes_per_request" not in missed_targets,
        "peak_resident_kv": "peak_resident_kv" not in missed_targets,
        "vericache_gain_at_32_sessions": (
            vericache_gain["median"] >= TARGETS["vericache_gain"] if vericache_gain else None
        ),
        "identical": identical,
    }
    return summary


def _peaks(cell: dict) -> dict[str, int]:
    return {worker: kv["peak_kv_bytes"] for worker, kv in cell["workers"].items()}


def _gains(by_key: dict, spec: SharingSpec) -> dict[str, dict[str, float]]:
    """After over before per cell, each sample over the sample served beside it."""
    if not {"before", "after"} <= set(spec.codes):
        return {}
    gains = {}
    for mode in spec.modes:
        for layout in spec.layouts:
            after = by_key[("after", mode, layout.name)]["samples"]
            before = by_key[("before", mode, layout.name)]["samples"]
            ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(after, before)]
            gains[f"{mode} {layout.name}"] = {
                "median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
            }  # fmt: skip
    return gains


def _missed(cells: list[dict], code: str) -> list[dict]:
    """The code's cells that miss a target, and by how much."""
    limit = TARGETS["bytes_per_request_over_prefix"]
    missed = []
    for cell in (c for c in cells if c["code"] == code):
        for path in ("store", "link"):
            over = cell[f"{path}_over_prefix"]
            if over > limit:
                missed.append(
                    {"cell": cell["name"], "target": f"{path}_bytes_per_request", "value": over}
                )
        for worker, kv in cell["workers"].items():
            ratio = kv["peak_kv_over_allowance"]
            if ratio is not None and ratio > TARGETS["peak_kv_over_allowance"]:
                missed.append(
                    {"cell": cell["name"], "target": "peak_resident_kv", "worker": worker,
                     "value": ratio}
                )  # fmt: skip
    return missed
