"""The prefix-sharing benchmark's plumbing without a server: its cells, the per-request and
per-worker arithmetic against issue 39's targets, before/after pairing and the plot; the export
of a commit's tree; and one tiny run of the working tree's code on Ray (slow)."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from vericache.bench import prefix_sharing
from vericache.bench.prefix_sharing_summary import Layout, cell_records, summarize
from vericache.cli.bench import parse_benchmark_args
from vericache.errors import InvalidRequestError


def _args(*argv: str):
    module, args = parse_benchmark_args("prefix-sharing", list(argv))
    assert module is prefix_sharing
    return args


def test_quick_defaults_shrink_the_table_and_explicit_values_win():
    full = prefix_sharing.sharing_spec(_args())
    quick = prefix_sharing.sharing_spec(_args("--quick"))
    assert full.codes == ("before", "after") and full.repeats == 3 and quick.repeats == 1
    assert full.session_counts == (1, 8, 32) and full.prefix_counts == (1, 4)
    assert full.modes == ("vericache", "full_local", "full_remote") and full.num_drafters == 2
    assert full.headline == Layout(32, 1) and quick.headline == Layout(8, 1)
    assert len(full.layouts) == 6 and max(quick.session_counts) < 32
    spec = prefix_sharing.sharing_spec(_args("--quick", "--codes", "after", "--sessions", "3"))
    assert (
        spec.codes == ("after",) and spec.session_counts == (3,) and spec.reference_code == "after"
    )
    for bad in (["--codes", "later"], ["--modes", "vericache"], ["--sessions", "0"],
                ["--prefixes", "1,1"]):  # fmt: skip
        with pytest.raises(InvalidRequestError):
            prefix_sharing.sharing_spec(_args(*bad))


def test_a_layout_serves_every_prefix_and_every_session():
    assert Layout(1, 4).num_requests == 4 and Layout(1, 4).sessions_per_prefix == 1
    assert Layout(32, 4).num_requests == 32 and Layout(32, 4).sessions_per_prefix == 8
    assert Layout(8, 1).name == "s=8 p=1"


# One prefix of 1000 tokens, 100 bytes of full KV per token; 40 bytes per request of compressed
# KV on the link, 80 of full KV.
PREFIX = {"num_tokens": 1000, "full_kv_bytes": 100_000, "compressed_wire_bytes": 40_000,
          "full_wire_bytes": 80_000}  # fmt: skip


def _sample(rate, store, link, workers, num_requests=4, num_tokens=5) -> dict:
    requests = [{"store_bytes": 0, "link_bytes": 0, "num_tokens": num_tokens}] * num_requests
    return {"tokens_per_s": rate, "store_bytes": store, "link_bytes": link,
            "requests": requests, "workers": workers}  # fmt: skip


def _kv(peak, prefix, sessions) -> dict:
    return {"max_sessions": sessions, "sessions_kv_peak_bytes": peak - prefix,
            "prefix_kv_bytes": prefix, "peak_kv_bytes": peak, "sessions_at_peak": sessions,
            "num_readings": 3}  # fmt: skip


def _samples(spec, gain=2.5, shared=True, wrong=()):
    """Host replies for every cell of a table of one layout, 4 sessions on one prefix: before
    each session copies the prefix, after it holds its 10 own tokens (5 after the prefix in its
    prompt, 5 output) alone."""
    layout = Layout(4, 1)
    own = 10 * 100  # bytes of a session's own tokens
    samples = {}
    links = {"vericache": 40_000 + 4 * own, "full_remote": 80_000, "full_local": 0}
    for code in spec.codes:
        session_bytes = own if code == "after" and shared else 100_000 + own
        for mode in spec.modes:
            store = 0 if mode == "full_remote" else 100_000
            on_verifier = 0 if mode == "full_remote" else 4
            workers = {
                "verifier-0": _kv(100_000 + on_verifier * session_bytes, 100_000, on_verifier),
                "drafter-0": _kv(40_000, 40_000, 0),
            }
            replies = []
            for repeat, base in enumerate((10.0, 12.0, 11.0)):
                rate = base * gain if code == "after" else base
                outputs = [[9]] if (code, mode, repeat) in wrong else [[1]]
                sample = _sample(rate, store, links[mode], workers)
                replies.append({"sample": sample, "outputs": outputs * 4})
            samples[(code, mode, layout)] = replies
    prefixes = {code: [PREFIX] for code in spec.codes}
    return samples, {layout: {"prefixes": prefixes, "suffix_tokens": [5] * 4}}


def _spec(*argv):
    return prefix_sharing.sharing_spec(
        _args("--sessions", "4", "--prefixes", "1", "--repeats", "3", *argv)
    )


def test_the_summary_sets_each_cell_against_issue_39s_targets():
    spec = _spec()
    samples, plans = _samples(spec)
    cells = cell_records(samples, plans, spec)
    summary = summarize(cells, spec)
    assert summary["headline_cell"] == "4 sessions on 1 prefix(es)"
    # One copy of the prefix for 4 sessions, whatever the path; VERICACHE's own tokens apart.
    assert summary["store_bytes_per_request_over_prefix"]["vericache"] == pytest.approx(1.0)
    assert summary["link_bytes_per_request_over_prefix"] == pytest.approx(
        {"vericache": 1.0, "full_remote": 1.0, "full_local": 0.0}
    )
    assert summary["peak_kv_over_allowance"]["full_local"]["verifier-0"] == pytest.approx(1.0)
    assert summary["vericache_gain_at_32_sessions"] == pytest.approx(2.5)
    assert summary["vericache_gain_at_32_sessions_range"] == pytest.approx([2.5, 2.5])
    assert summary["identical"] is True and summary["missed"] == []
    assert all(summary["meets_targets"].values())
    before = next(c for c in cells if c["name"] == "before full_local s=4 p=1")
    # Four sessions each with a copy of the prefix, against one copy and their own tokens.
    assert before["workers"]["verifier-0"]["peak_kv_over_allowance"] == pytest.approx(
        (100_000 + 4 * 101_000) / (100_000 + 4 * 1000)
    )


def test_a_slower_after_code_or_an_unshared_prefix_misses_its_target():
    spec = _spec()
    samples, plans = _samples(spec, gain=1.5, shared=False)
    samples[("after", "vericache", Layout(4, 1))][0]["sample"]["link_bytes"] = 200_000
    summary = summarize(cell_records(samples, plans, spec), spec)
    assert summary["meets_targets"]["vericache_gain_at_32_sessions"] is False
    assert summary["meets_targets"]["peak_resident_kv"] is False
    missed = {(m["cell"], m["target"]) for m in summary["missed"]}
    assert ("after full_local s=4 p=1", "peak_resident_kv") in missed
    # One sample of three over: the median stays within the target.
    assert summary["meets_targets"]["link_bytes_per_request"] is True


def test_gains_pair_each_sample_with_the_one_served_beside_it():
    spec = _spec()
    samples, plans = _samples(spec)
    before = samples[("before", "vericache", Layout(4, 1))]
    for reply, rate in zip(before, (10.0, 30.0, 12.0)):  # the machine slowed during one
        reply["sample"]["tokens_per_s"] = rate
    after = samples[("after", "vericache", Layout(4, 1))]
    for reply, rate in zip(after, (25.0, 72.0, 31.2)):
        reply["sample"]["tokens_per_s"] = rate
    gain = summarize(cell_records(samples, plans, spec), spec)["gain_by_cell"]["vericache s=4 p=1"]
    assert gain == pytest.approx({"median": 2.5, "min": 2.4, "max": 2.6})


def test_outputs_are_checked_against_the_working_trees_full_kv_decoding():
    spec = _spec()
    samples, plans = _samples(spec, wrong={("before", "vericache", 1)})
    cells = cell_records(samples, plans, spec)
    cell = next(c for c in cells if c["name"] == "before vericache s=4 p=1")
    assert cell["outputs_match"] == [True, False, True]
    assert summarize(cells, spec)["identical"] is False
    only_after = _spec("--codes", "after")
    samples, plans = _samples(only_after)
    summary = summarize(cell_records(samples, plans, only_after), only_after)
    assert summary["identical"] is True and summary["vericache_gain_at_32_sessions"] is None
    assert summary["meets_targets"]["vericache_gain_at_32_sessions"] is None


class _Host:
    """A code's host process, recording what it was asked into a log it shares."""

    def __init__(self, code: str, log: list):
        self.code, self.log = code, log

    def call(self, op: str, **fields) -> dict:
        if op == "serve":
            self.log.append(
                (self.code, op, fields["mode"], fields["concurrency"], len(fields["jobs"]))
            )
            return {"sample": {"tokens_per_s": 1.0}, "outputs": []}
        self.log.append((self.code, op))
        return {"startup_s": 1.0} if op == "start" else {}


def test_each_code_serves_a_session_counts_cells_on_a_server_of_its_own_in_turn():
    spec = _spec(
        "--sessions", "1,8", "--prefixes", "1,4", "--repeats", "2", "--modes", "full_local"
    )
    log = []
    hosts = {code: _Host(code, log) for code in spec.codes}
    plans = {layout: {"jobs": {code: [("p", "q")] * layout.num_requests for code in hosts}}
             for layout in spec.layouts}  # fmt: skip
    samples, startup_s = prefix_sharing._serve_all(hosts, spec, plans)

    def block(code, sessions):  # one server: started, its cells, stopped
        cells = [(code, "serve", "full_local", sessions, max(sessions, p)) for p in (1, 4)]
        return [(code, "start"), *cells, (code, "stop")]

    assert log == [
        *block("before", 1), *block("after", 1), *block("after", 8), *block("before", 8),
        *block("after", 1), *block("before", 1), *block("before", 8), *block("after", 8),
    ]  # fmt: skip
    assert len(samples[("after", "full_local", Layout(8, 4))]) == 2
    assert startup_s == {"before": [1.0] * 4, "after": [1.0] * 4}


def test_the_plot_shows_both_codes(tmp_path):
    spec = _spec()
    samples, plans = _samples(spec)
    cells = cell_records(samples, plans, spec)
    result = {"cells": cells, "summary": summarize(cells, spec), "config": {
        "codes": list(spec.codes), "num_drafters": 2, "prefix_tokens": [1000, 1000],
        "max_tokens": 5, "compressor": "snapkv-4x-bf16", "link_bytes_per_s": 1e8, "repeats": 3,
    }}  # fmt: skip
    path = tmp_path / "prefix_sharing.png"
    prefix_sharing.plot(result, path)
    assert path.stat().st_size > 1000


def _is_git_checkout() -> bool:
    if shutil.which("git") is None:
        return False
    root = prefix_sharing.repository_root()
    done = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True)
    return done.returncode == 0


@pytest.mark.skipif(not _is_git_checkout(), reason="needs the repository's git history")
def test_a_commit_is_exported_into_a_tree_of_its_own():
    with prefix_sharing.exported(prefix_sharing.repository_root(), "HEAD") as tree:
        assert (tree / "vericache" / "__init__.py").is_file() and not (tree / ".git").exists()
    assert not tree.exists()
    with pytest.raises(InvalidRequestError, match="--codes after"):
        with prefix_sharing.exported(prefix_sharing.repository_root(), "0" * 40):
            pass


@pytest.mark.slow
@pytest.mark.ray
def test_a_tiny_run_of_the_working_tree_end_to_end(tiny_chat_checkpoint, tmp_path):
    """The working tree alone (a clean checkout has no history to export the before code from):
    a host process of its own, with its own Ray instance."""
    args = _args(
        "--quick", "--codes", "after", "--model", str(tiny_chat_checkpoint),
        "--prefix-tokens", "150,300", "--sessions", "2", "--prefixes", "1,2",
        "--max-tokens", "4", "--draft-len", "4",
    )  # fmt: skip
    result = prefix_sharing.run(args)
    json.dumps(result)  # what the CLI writes
    summary = result["summary"]
    assert summary["identical"] is True
    assert summary["headline_cell"] == "2 sessions on 1 prefix(es)"
    assert set(summary["store_bytes_per_request_over_prefix"]) == {
        "vericache", "full_local", "full_remote",
    }  # fmt: skip
    # One store read of the prefix's full KV for both sessions.
    assert summary["store_bytes_per_request_over_prefix"]["full_local"] == pytest.approx(1.0)
    root = str(prefix_sharing.repository_root())
    assert all(f.startswith(root) for f in result["codes"]["after"]["worker_vericache_files"])
    names = {cell["name"] for cell in result["cells"]}
    assert len(names) == 3 * 2 and "after vericache s=2 p=2" in names
    assert [p["cells"] for p in result["prefixes"]] == ["p=1", "p=2", "p=2"]
    for cell in result["cells"]:
        assert set(cell["workers"]) == {"verifier-0", "drafter-0", "drafter-1"}
        assert cell["tokens_per_s"] > 0 and cell["outputs_match"] == [True]
    local = next(c for c in result["cells"] if c["name"] == "after full_local s=2 p=1")
    assert local["workers"]["verifier-0"]["prefix_kv_bytes"] > 0
