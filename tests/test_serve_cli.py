"""`hybrid-cache serve` as a user runs it: a subprocess on a free port answers an `openai`
client (with its API key) and stops cleanly on Ctrl-C; bad flags fail before the model
loads."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from hybrid_cache.cli import main

REPO_ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_serve(args: list[str], **env: str) -> tuple[subprocess.Popen, str]:
    """`hybrid-cache serve ARGS --port P` in a subprocess (this checkout's package, `env` added
    to the environment), once its `/health` answers 200: the process and its base URL. The
    process is killed if it does not start within 60 s."""
    port = free_port()
    environment = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "python"), **env}
    command = [sys.executable, "-m", "hybrid_cache", "serve", *args, "--port", str(port)]
    process = subprocess.Popen(
        command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, process.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    return process, url
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
    except BaseException:
        process.kill()
        process.communicate(timeout=30)
        raise


def test_serve_answers_a_client_and_stops_on_interrupt(serve_model_folder):
    process, url = start_serve(
        [serve_model_folder, "--kv-cache-memory", "2MiB", "--max-model-len", "256",
         "--served-model-name", "tiny", "--log-level", "warning"],
        HYBRID_CACHE_API_KEY="k",
    )  # fmt: skip
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
        reply = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5
        )
        assert reply.usage.completion_tokens >= 1
        assert httpx.get(url + "/v1/models").status_code == 401  # the key from the environment
    finally:
        process.send_signal(signal.SIGINT)
        output = process.communicate(timeout=30)[0]
    assert process.returncode == 0, output


@pytest.mark.parametrize(
    "argv, says",
    [
        (["serve"], "give the model"),
        (["serve", "tiny-gemma3", "--model", "tiny-llama"], "differ"),
        (["serve", "tiny-gemma3", "--port", "70000"], "--port"),
        (["serve", "tiny-gemma3", "--max-request-bytes", "lots"], "--max-request-bytes"),
        (["serve", "tiny-gemma3", "--max-pending-requests", "0"], "--max-pending-requests"),
        (["serve", "tiny-gemma3", "--max-num-seqs", "0"], "--max-num-seqs"),
    ],
)
def test_bad_flags_fail_before_the_model_loads(argv, says, capsys):
    assert main(argv) == 1
    assert says in capsys.readouterr().err
