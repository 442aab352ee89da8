"""Real engine servers on 127.0.0.1 for tests (uvicorn in a thread of this process), a tiny
byte-level tokenizer for the tiny model, and small HTTP helpers."""

from __future__ import annotations

import http.client
import json
import shutil
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from cachetier.engine.server.app import create_app
from cachetier.engine.server.config import EngineServerConfig
from tests.server.live import wait_healthy
from tests.support import AppThread

# Byte-level: token id b is byte b, so every text encodes and multi-byte characters span
# several tokens (what incremental decoding must not split).
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def add_byte_tokenizer(folder: Path) -> None:
    """Write tokenizer.json and tokenizer_config.json (with a chat template) into ``folder``."""
    # GPT-2's printable stand-ins for the 256 byte values, in byte order.
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    stand_in, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            stand_in[byte] = chr(byte)
        else:
            stand_in[byte] = chr(256 + extra)
            extra += 1
    vocab = {stand_in[b]: b for b in range(256)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def chat_model(tiny_model_dir: Path, dest: Path) -> Path:
    """A copy of the tiny model with the byte tokenizer."""
    shutil.copytree(tiny_model_dir, dest)
    add_byte_tokenizer(dest)
    return dest


def server_config(model: Path, **overrides: Any) -> EngineServerConfig:
    """A config for the tiny model: a 4 MiB pool, port 0 (the OS picks), quiet logs."""
    engine_args = {"kv_cache_bytes": 4 << 20, **overrides.pop("engine_args", {})}
    values: dict[str, Any] = dict(
        model=str(model),
        served_model_name="tiny",
        port=0,  # EngineServer.port says which once started
        log_level="warning",
        engine_args=engine_args,
    )
    values.update(overrides)
    return EngineServerConfig(**values)


class EngineServer(AppThread):
    """The engine server (``create_app(config)``) in a thread; restartable on the same port."""

    def __init__(self, config: EngineServerConfig) -> None:
        super().__init__(
            lambda: create_app(config),
            config.port,
            log_level=config.log_level,
            name="engine server",
            start_timeout_s=60,
        )
        self.config = config

    def start(self) -> EngineServer:
        self.start_thread()
        # A restart (and ``with_config``) listens where this start did.
        self.config = replace(self.config, port=self.port)
        wait_healthy(self.url)
        return self

    def with_config(self, **changes: Any) -> EngineServer:
        return EngineServer(replace(self.config, **changes))


def post(url: str, path: str, payload: Any, **headers: str) -> tuple[int, Any]:
    """POST JSON; returns (status, decoded answer)."""
    status, body = post_raw(url, path, json.dumps(payload).encode(), **headers)
    return status, json.loads(body) if body else None


def post_raw(url: str, path: str, body: bytes | list[bytes], **headers: str) -> tuple[int, bytes]:
    """POST ``body`` as it is; a list of chunks goes chunked, without a Content-Length."""
    host, port = url.removeprefix("http://").split(":")
    # Far above an answer's time: a fresh server's first forward may wait for the C++ kernels
    # to compile (once per environment), beside another worker and maybe another suite.
    conn = http.client.HTTPConnection(host, int(port), timeout=300)
    try:
        conn.request(
            "POST",
            path,
            body=iter(body) if isinstance(body, list) else body,
            headers={"Content-Type": "application/json", **headers},
        )
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def get(url: str, path: str, **headers: str) -> tuple[int, bytes]:
    host, port = url.removeprefix("http://").split(":")
    # Far above an answer's time: a fresh server's first forward may wait for the C++ kernels
    # to compile (once per environment), beside another worker and maybe another suite.
    conn = http.client.HTTPConnection(host, int(port), timeout=300)
    try:
        conn.request("GET", path, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def stream(url: str, path: str, payload: Any) -> list[Any]:
    """POST a streaming request; returns its events (decoded JSON, and "[DONE]")."""
    status, body = post_raw(url, path, json.dumps({**payload, "stream": True}).encode())
    assert status == 200, body
    return list(parse_sse(body.decode()))


def parse_sse(text: str) -> Iterator[Any]:
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), f"not an SSE data event: {block!r}"
        data = block.removeprefix("data: ")
        yield data if data == "[DONE]" else json.loads(data)


def metric(url: str, name: str, **labels: str) -> float:
    """The value of one series of ``/metrics`` (0 if absent)."""
    status, body = get(url, "/metrics")
    assert status == 200
    for line in body.decode().splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        series, _, value = line.rpartition(" ")
        head, _, rest = series.partition("{")
        if head != name:
            continue
        found = dict(part.split("=", 1) for part in rest.rstrip("}").split(",") if part)
        if all(found.get(k) == f'"{v}"' for k, v in labels.items()):
            return float(value)
    return 0.0
