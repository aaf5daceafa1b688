"""``pdgate serve --host/--port`` win over the file's ``server`` section, and the running config says
so: /admin/config shows the port the gateway listens on, before and after a reload, and a reload
does not take the file's port for a change of a restart-only section (issue 28, point 8)."""

from __future__ import annotations

import sys

import httpx
import pytest
import yaml

from tests.procs import ProcGroup, free_port, wait_for

pytestmark = pytest.mark.e2e

TOKEN = "overrides-admin-token"


@pytest.mark.parametrize("workers", [1, 2])
def test_admin_config_shows_the_port_given_on_the_command_line(tmp_path, tokenizer_dir, workers):
    file_port, port = free_port(), free_port()
    config = tmp_path / "gateway.yaml"
    data = {
        "server": {"port": file_port, "workers": workers},
        "models": [{"name": "m", "tokenizer": str(tokenizer_dir), "max_model_len": 1024}],
        "pools": {"decode": {"endpoints": [f"http://127.0.0.1:{free_port()}"]}},
        "admin": {"token_env": "PDGATE_TEST_OVERRIDES_TOKEN"},
    }
    config.write_text(yaml.safe_dump(data))
    group = ProcGroup(tmp_path)
    try:
        gw = group.start(
            "gateway",
            [sys.executable, "-m", "gateway", "serve", "--config", str(config), "--port", str(port)],
            env={"PDGATE_TEST_OVERRIDES_TOKEN": TOKEN},
        )
        gw.wait_http(f"http://127.0.0.1:{port}/health", timeout=60)

        def shown() -> dict:
            r = httpx.get(f"http://127.0.0.1:{port}/admin/config", headers={"authorization": f"Bearer {TOKEN}"})
            assert r.status_code == 200
            return r.json()

        first = shown()
        assert first["config"]["server"]["port"] == port
        data["routing"] = {"decider": {"name": "token_threshold", "threshold": 100}}
        (tmp_path / "next.yaml").write_text(yaml.safe_dump(data))
        (tmp_path / "next.yaml").replace(config)  # atomically, as editors and ConfigMaps do
        # With two workers each reloads on its own poll; judge the answer of one that has reloaded.
        reloaded: list[dict] = []

        def new_version_shown() -> bool:
            answer = shown()
            if answer["version"] == first["version"]:
                return False
            reloaded.append(answer)
            return True

        assert wait_for(new_version_shown, timeout=30)
        after = reloaded[-1]
        assert after["config"]["server"]["port"] == port
        assert after["config"]["routing"]["decider"]["threshold"] == 100
        assert "server section changed" not in gw.log_path.read_text()
    finally:
        group.stop_all()
