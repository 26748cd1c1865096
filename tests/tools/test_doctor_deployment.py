"""``doctor --config``: the deployment's connector, num_ubatches, the
stage -> HCCL group map with aliasing flagged, aiv_num/ffn_core_num, and
the rollout mode and rung, from a vLLM config file (YAML or JSON) or a
JSON string; a config that cannot be read is a problem, never a raise."""

from __future__ import annotations

import json
from pathlib import Path

from support.child import run_cli

from camp2p_overlap.core.config import OverlapConfig
from camp2p_overlap.tools.deployment import read_deployment

YAML_CONFIG = """\
model: deepseek-ai/DeepSeek-V2-Lite
ubatch-size: 3
additional-config: '{"afd": {"afd_connector": "CAMP2pAFDConnector", "afd_role": "ffn",
  "connector_extra_config": {"core_num": 16, "ffn_core_num": 24}}}'
"""


def _groups(d: dict) -> dict[int, str | None]:
    return {r["stage"]: r["group"] for r in d["stages"]}


def test_yaml_vllm_config_with_three_micro_batches(tmp_path: Path) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text(YAML_CONFIG)
    d = read_deployment(str(path), OverlapConfig(enabled=True, mode="parity"))
    assert d["problems"] == [] and d["source"] == str(path)
    assert (d["connector"], d["role"]) == ("CAMP2pAFDConnector", "ffn")
    assert (d["num_ubatches"], d["num_ubatches_from"]) == (3, "ubatch_size")
    assert _groups(d) == {0: "afd", 1: "afd1", 2: "afd2"}
    assert d["aliased"] == {}
    assert d["extra"] == {"core_num": 16, "ffn_core_num": 24, "attn_core_num": None, "aiv_num": 24}
    assert (d["mode"], d["rung"]) == ("parity", "parity")


def test_one_micro_batch_aliases_stage_one_onto_the_first_group(tmp_path: Path) -> None:
    path = tmp_path / "ffn.json"
    path.write_text(json.dumps({"afd": {"connector": "CAMP2pAFDConnector", "role": "ffn"}}))
    d = read_deployment(str(path), OverlapConfig(enabled=True))
    assert d["num_ubatches"] == 1
    assert _groups(d) == {0: "afd", 1: "afd", 2: None}
    assert d["aliased"] == {"afd": [0, 1]}
    stage1 = d["stages"][1]
    assert stage1["shares_group_with"] == [0] and not stage1["in_use"]
    assert "third HCCL group" in d["stages"][2]["error"]
    assert any("stages 0, 1 map to one HCCL group 'afd'" in n for n in d["notes"])
    assert any("the overlap will not engage" in n for n in d["notes"])
    assert d["extra"]["aiv_num"] == 8  # afd-plugin's default core_num


def test_dbo_gives_two_groups_and_stage_two_none() -> None:
    src = json.dumps({"enable_dbo": True, "additional_config": {"afd": {"connector": "CAMP2pAFDConnector"}}})
    overlap = OverlapConfig(enabled=True, layouts=("comm-side",), e2a_on_side_stream=True, a2e_on_side_stream=False)
    d = read_deployment(src, overlap)
    assert d["source"] == "inline JSON"
    assert (d["num_ubatches"], d["num_ubatches_from"]) == (2, "enable_dbo")
    assert _groups(d) == {0: "afd", 1: "afd1", 2: None}
    assert d["rung"] == "e2a-only"
    assert any("role is 'attention'" in n for n in d["notes"])  # afd-plugin's default role


def test_wrong_connector_and_unknown_extra_fields_are_problems() -> None:
    src = json.dumps(
        {
            "afd": {
                "connector": "CAMAsyncAFDConnector",
                "role": "attention",
                "connector_extra_config": {"attn_core_num": 4, "ffn_core_num": "x"},
            }
        }
    )
    d = read_deployment(src, None)
    assert any("the overlap applies to CAMP2pAFDConnector only" in p for p in d["problems"])
    assert any("ffn_core_num='x' is not an integer" in p for p in d["problems"])
    assert d["extra"]["aiv_num"] == 4  # attention role: attn_core_num

    src = json.dumps({"afd": {"connector": "CAMP2pAFDConnector", "connector_extra_config": {"aiv_cores": 8}}})
    d = read_deployment(src, None)
    assert d["problems"] == ["connector_extra_config has field(s) the CAMP2P connector rejects: aiv_cores"]


def test_unreadable_configs_are_problems_not_errors(tmp_path: Path) -> None:
    cases = {
        str(tmp_path / "missing.yaml"): "cannot read",
        "{not json": "not valid JSON",
        '{"model": "x"}': "no AFD section",
        '{"additional_config": "{bad"}': "additional_config is not valid JSON",
        '{"afd": [1, 2]}': "not a mapping",
    }
    bad_yaml = tmp_path / "bad.yml"
    bad_yaml.write_text("a: [1, 2\n")
    cases[str(bad_yaml)] = "not valid YAML"
    for source, text in cases.items():
        d = read_deployment(source, None)
        assert len(d["problems"]) == 1 and text in d["problems"][0], (source, d["problems"])


def test_doctor_json_grows_with_the_deployment_and_the_rung(tmp_path: Path) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text(YAML_CONFIG)
    env = {"VLLM_CAMP2P_MULTISTREAM": "1", "VLLM_CAMP2P_MULTISTREAM_MODE": "reorder"}
    res = run_cli("doctor", "--json", "--config", str(path), env=env, timeout=120)
    d = json.loads(res.stdout)
    assert d["config"]["mode"] == "reorder" and d["config"]["rung"] == "reorder"
    dep = d["deployment"]
    assert dep["connector"] == "CAMP2pAFDConnector" and dep["num_ubatches"] == 3
    assert (dep["mode"], dep["rung"]) == ("reorder", "reorder")
    assert dep["extra"]["aiv_num"] == 24
    res = run_cli("doctor", "--config", str(path), env=env, timeout=120)
    assert "stage 2 -> group afd2" in res.stdout
    assert "mode reorder, rung reorder" in res.stdout
    res = run_cli("doctor", "--json", env=env, timeout=120)
    assert json.loads(res.stdout)["deployment"] is None


def test_doctor_gives_the_core_budget_and_each_layouts_verdict(tmp_path: Path) -> None:
    """``doctor --config``: the core rule with the deployment's aiv_num (24) and stage count (3): the device's count
    from the variable here (no NPU); with the MoE collective's unset, the whole device (the strictest reading)."""
    path = tmp_path / "serve.yaml"
    path.write_text(YAML_CONFIG)
    env = {
        "VLLM_CAMP2P_MULTISTREAM": "1",
        "VLLM_CAMP2P_MULTISTREAM_VECTOR_CORES": "48",
        "VLLM_CAMP2P_MULTISTREAM_LAYOUT": "compute-side,comm-side",
    }
    d = json.loads(run_cli("doctor", "--json", "--config", str(path), env=env).stdout)
    c = d["cores"]
    assert (c["vector"], c["cam"], c["moe"], c["stages"]) == (48, 24, None, 3)
    assert c["cam_from"] == f"aiv_num of {path}"
    assert [(v["layout"], v["needed"], v["fits"]) for v in c["verdicts"]] == [
        ("compute-side", 24 + 48, False),
        ("comm-side", 3 * 24 + 48, False),
    ]
    assert any(n.startswith("core budget: no listed layout fits") for n in d["notes"])
    env["VLLM_CAMP2P_MULTISTREAM_MOE_CORES"] = "24"
    text = run_cli("doctor", "--config", str(path), env=env).stdout
    assert "core budget (3 stage(s)): an overlap layout engages only where its kernels fit" in text
    assert "[fits] compute-side with 3 stage(s): CAM 24 on C + MoE collective 24 on F = 48 vector cores at once" in text
    assert "[SERIAL] comm-side with 3 stage(s)" in text


def test_doctor_without_the_count_says_the_rule_engages_nothing() -> None:
    d = json.loads(run_cli("doctor", "--json", env={"VLLM_CAMP2P_MULTISTREAM": "1"}).stdout)
    c = d["cores"]
    assert c["vector"] is None and c["vector_from"] == "no NPU here to read it from"
    assert c["verdicts"][0]["fits"] is False and "VLLM_CAMP2P_MULTISTREAM_VECTOR_CORES" in c["verdicts"][0]["text"]
