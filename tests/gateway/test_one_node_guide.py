"""docs/one-node.md: its GPU commands are its tested CPU commands but for the hardware lines (and
``vllm serve`` for the CPU package's module, see the guide), and
its gateway command is one the CLI takes (tests/realvllm/guide.py reads the tested blocks)."""

from __future__ import annotations

import json
import re

import yaml

from gateway.cli import main
from tests.realvllm import guide

HARDWARE_ENV = {"CUDA_VISIBLE_DEVICES", "VLLM_CPU_KVCACHE_SPACE"}


def _gpu_blocks() -> dict[str, guide.Command]:
    text = guide.GUIDE.read_text()
    section = text.split("### On GPUs", 1)[1].split("### Without a GPU", 1)[0]
    found = {}
    for body in re.findall(r"```bash\n(.*?)\n```", section, re.S):
        cmd = guide.parse(body)
        found["prefill" if "8100" in cmd.argv else "decode"] = cmd
    return found


def test_gpu_and_cpu_engine_commands_differ_only_in_hardware():
    gpu = _gpu_blocks()
    assert set(gpu) == {"prefill", "decode"}
    for role, g in gpu.items():
        c = guide.command(f"engine {role}")
        assert {k: v for k, v in g.env.items() if k not in HARDWARE_ENV} == {
            k: v for k, v in c.env.items() if k not in HARDWARE_ENV
        }
        gkv, ckv = json.loads(g.flag("--kv-transfer-config")), json.loads(c.flag("--kv-transfer-config"))
        assert ckv.pop("kv_buffer_device") == "cpu" and gkv == ckv
        assert g.argv[:3] == ["vllm", "serve", "$MODEL"]
        assert c.argv[:5] == ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "$MODEL"]
        gpu_flags = [w for w in g.argv[3:] if not w.startswith("{")]
        cpu_flags = [w for w in c.argv[5:] if not w.startswith("{")]
        assert gpu_flags == cpu_flags


def test_the_guides_engines_and_gateway_agree(capsys):
    decode = guide.command("engine decode")
    gw = guide.command("gateway")
    assert (
        gw.flag("--hash-seed") == decode.env["PYTHONHASHSEED"] == guide.command("engine prefill").env["PYTHONHASHSEED"]
    )
    events = json.loads(decode.flag("--kv-events-config"))["endpoint"]
    i = gw.argv.index("--decode")
    assert gw.argv[i + 1].endswith(":" + decode.flag("--port")) and events.endswith(":" + gw.argv[i + 2])
    assert gw.flag("--prefill").endswith(":" + guide.command("engine prefill").flag("--port"))
    # Two engines on one machine: their NIXL side channels must not clash.
    assert (
        decode.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] != guide.command("engine prefill").env["VLLM_NIXL_SIDE_CHANNEL_PORT"]
    )
    argv = [w.replace("$MODEL", "Qwen/Qwen3-0.6B") for w in gw.argv[1:]]
    assert main([*argv, "--max-model-len", "8192", "--print-config"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["pools"]["decode"]["endpoints"][0]["kv_events"] == "tcp://127.0.0.1:5557"
