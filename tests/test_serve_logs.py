"""Server logs: JSON lines carrying the request id and outcome of every served request, and the
text format with the same fields after the message."""

from __future__ import annotations

import io
import json
import logging

import pytest

from tests.serve_fixtures import CONTEXT, start_server
from vericache.client import Client
from vericache.serve.logs import configure_logging


@pytest.fixture
def captured():
    stream = io.StringIO()
    logger = logging.getLogger("vericache")
    saved = logger.handlers, logger.level, logger.propagate
    yield stream
    logger.handlers, logger.level, logger.propagate = saved


def test_each_served_request_logs_one_json_line(captured, tiny_chat_checkpoint, tmp_path):
    configure_logging("json", stream=captured)
    with start_server(tiny_chat_checkpoint, tmp_path / "store") as server:
        with Client(server.target, timeout=120) as client:
            prefix_id = client.put_prefix(CONTEXT, compressor="streamingllm", ratio=4)
            results = [
                client.generate("Go on.", prefix_id=prefix_id, max_tokens=8, mode=mode)
                for mode in ("vericache", "full_local")
            ]
    lines = [json.loads(line) for line in captured.getvalue().splitlines()]
    finished = [e for e in lines if e["message"] == "request finished"]
    assert [e["mode"] for e in finished] == ["vericache", "full_local"]
    assert len({e["request_id"] for e in finished}) == 2
    for entry, result in zip(finished, results):
        assert entry["output_tokens"] == len(result.token_ids)
        assert entry["finish_reason"] == result.finish_reason
        assert entry["prefix_id"] == prefix_id and entry["level"] == "INFO"
    assert finished[0]["mean_accepted_per_round"] is not None


def test_text_lines_carry_the_fields_after_the_message(captured):
    configure_logging("text", stream=captured)
    logging.getLogger("vericache.serve.test").info("done", extra={"request_id": "r-1"})
    assert captured.getvalue().rstrip().endswith("vericache.serve.test: done request_id=r-1")
    with pytest.raises(ValueError):
        configure_logging("xml")
