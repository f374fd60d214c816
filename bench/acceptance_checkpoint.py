"""The acceptance benchmark's checkpoint: finished work in a JSON-lines file, so that a long run
that stops keeps what it finished and a run given the file again skips it."""

from __future__ import annotations

import json
from pathlib import Path


class Checkpoint:
    """Finished work in a JSON-lines file, each line with the run's settings: the full-KV
    references of a sampling setting, or a compressor's records for one draft KV source. A long
    run that stops keeps what it finished."""

    def __init__(self, path: Path | None, settings: dict):
        self.path, self.settings = path, settings
        self._done: dict[tuple[str, str], list[dict]] = {}
        self._references: dict[str, list[tuple[int, ...]]] = {}
        if path is not None and path.is_file():
            for line in path.read_text().splitlines():
                self._load(json.loads(line))

    def _load(self, entry: dict) -> None:
        if entry["settings"] != self.settings:
            raise ValueError(
                f"{self.path} holds records of other settings ({entry['settings']}): "
                "give another checkpoint file"
            )
        if "references" in entry:
            self._references[entry["references"]] = [tuple(ids) for ids in entry["token_ids"]]
        else:
            self._done[entry["compressor"], entry["draft_kv"]] = entry["records"]

    def records(self, label: str, draft_kv: str) -> list[dict] | None:
        return self._done.get((label, draft_kv))

    def references(self, label: str) -> list[tuple[int, ...]] | None:
        return self._references.get(label)

    def add(self, label: str, draft_kv: str, records: list[dict]) -> None:
        self._done[label, draft_kv] = records
        self._append({"compressor": label, "draft_kv": draft_kv, "records": records})

    def add_references(self, label: str, token_ids: list[tuple[int, ...]]) -> None:
        self._references[label] = token_ids
        self._append({"references": label, "token_ids": [list(ids) for ids in token_ids]})

    def _append(self, entry: dict) -> None:
        if self.path is not None:
            with self.path.open("a") as file:
                file.write(json.dumps({"settings": self.settings, **entry}) + "\n")
