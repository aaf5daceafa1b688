"""The whole app reloading the files its config names (issue 27, point 3): the keys file, the admin
token file and a chat template file, each edited alone (the config file untouched), applied by the
app's own watcher; and a reload that would switch keys off unsaid, refused with the keys kept."""

from __future__ import annotations

import os
import time
from pathlib import Path

import yaml
from starlette.testclient import TestClient

from gateway.config.reload import read_snapshot
from gateway.http.app import create_app
from tests.gateway.scripted_engine import ScriptedEngine
from tests.waiting import wait_for

TOKEN = "files-admin"


def replace(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def test_edits_of_the_files_the_config_names_reload_the_app(tmp_path, tokenizer_dir):
    engine = ScriptedEngine().start()
    try:
        keys, token, template = tmp_path / "keys", tmp_path / "admin-token", tmp_path / "chat.jinja"
        keys.write_text("sk-a\n")
        token.write_text(TOKEN)
        template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
        data = {
            "models": [
                {"name": "tiny", "tokenizer": str(tokenizer_dir), "max_model_len": 1024, "chat_template": str(template)}
            ],
            "pools": {"decode": {"endpoints": [engine.url]}},
            "auth": {"api_keys_file": str(keys)},
            "admin": {"token_file": str(token)},
        }
        path = tmp_path / "gateway.yaml"
        path.write_text(yaml.safe_dump(data))
        snap = read_snapshot(path)
        app = create_app(snap.load(path), config_path=path, config_version=snap.version)
        with TestClient(app) as client:

            def models(key: str) -> int:
                return client.get("/v1/models", headers={"authorization": f"Bearer {key}"}).status_code

            def prompt_tokens(admin: str = TOKEN) -> int | None:
                r = client.post(
                    "/debug/route",
                    headers={"authorization": f"Bearer {admin}"},
                    json={"model": "tiny", "messages": [{"role": "user", "content": "hello there"}]},
                )
                return r.json()["prompt_tokens"] if r.status_code == 200 else None

            assert models("sk-a") == 200 and models("sk-b") == 401
            replace(keys, "sk-b\n")  # the key rotated: sk-a revoked
            assert wait_for(lambda: models("sk-a") == 401, timeout=15)
            assert models("sk-b") == 200
            before = prompt_tokens()
            assert before is not None
            replace(
                template,
                "A long preamble the template adds to every prompt. " * 4
                + "{% for m in messages %}{{ m.content }}{% endfor %}",
            )
            assert wait_for(lambda: (prompt_tokens() or 0) > before, timeout=15), "the new template never applied"
            replace(token, "files-admin-2")  # the admin token rotated
            assert wait_for(lambda: prompt_tokens("files-admin-2") is not None, timeout=15)
            assert prompt_tokens() is None  # the old one no longer works
            # the keys section dropped without auth.disabled: refused, the keys stay
            rejected = client.get("/metrics").text.count('pdgate_config_reloads_total{result="rejected"} 1.0')
            replace(path, yaml.safe_dump({k: v for k, v in data.items() if k != "auth"}))
            assert wait_for(
                lambda: (
                    client.get("/metrics").text.count('pdgate_config_reloads_total{result="rejected"} 1.0') > rejected
                ),
                timeout=15,
            )
            time.sleep(0.2)
            assert models("sk-b") == 200 and models("nobody") == 401
    finally:
        engine.stop()
