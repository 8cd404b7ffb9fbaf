"""`kvbridge bench` reports what it measured: both copy baselines, the fresh-output ceiling, thread
counts, output modes, the reference's size and the machine (fields and consistency only; no timed assertions)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from cli.main import cli
from kvbridge.layouts import get_layout
from kvbridge.study import bench


def test_json_has_both_copies_threads_outputs_and_the_reference_size():
    run = CliRunner().invoke(cli, ["bench", "--tokens", "96", "--repeat", "2", "--threads", "2,1",
                                   "--reference-tokens", "40", "--json"])
    assert run.exit_code == 0, run.output
    report = json.loads(run.output)
    machine = report["machine"]
    assert machine["cpu"] and machine["cpu_cores"] >= 1 and isinstance(machine["cpu_vector"], list)
    assert report["tokens"] == 96 and report["reference_tokens"] == 40 and report["repeat"] == 2
    rows = report["results"]
    assert {(r["threads"], r["output"]) for r in rows} == {(1, "fresh"), (2, "fresh"), (1, "out="), (2, "out=")}
    for r in rows:
        assert r["exact"] and r["device"] == "cpu"
        assert r["kvbridge"]["tokens"] == 96 and r["reference"]["tokens"] == 40 and r["reference_capped"] is True
        for copy in ("copy", "np_copy"):  # same bytes as kvbridge moves, same token count
            assert r[copy]["bytes_moved"] == r["kvbridge"]["bytes_moved"] and r[copy]["tokens"] == 96
            assert r[copy]["gb_per_s"] > 0
        assert r["vs_np_copyto"] > 0 and r["vs_copy"] > 0
        assert r["case"].endswith(" into out=") == (r["output"] == "out=")
        ceiling = r["fresh_ceiling"]
        if r["output"] == "fresh":  # torch.empty + fill_ of exactly the output's bytes, in the same rounds
            assert ceiling["tokens"] == 96 and ceiling["gb_per_s"] > 0
            assert r["vs_fresh_ceiling"] > 0 and r["ceiling_vs_np_copyto"] > 0
        else:
            assert ceiling is None and r["vs_fresh_ceiling"] is None and r["ceiling_vs_np_copyto"] is None
    out_bytes = {r["case"]: r["fresh_ceiling"]["bytes_moved"] for r in rows if r["output"] == "fresh"}
    assert out_bytes["decode flashmla-model1 -> fp32 latents"] == 96 * 512 * 4
    assert out_bytes["encode bf16 latents -> flashmla-model1"] == 2 * get_layout("flashmla-model1").page_bytes(64)
    cases = {r["case"] for r in rows}
    fresh = {c for c in cases if not c.endswith(" into out=")}
    assert bench.TARGET_CASE in cases and {f"{c} into out=" for c in fresh} == cases - fresh  # every case both ways
    assert any(c.startswith("encode") for c in fresh) and any(c.startswith("decode") for c in fresh)
    assert report["cpu_target"]["threads"] == 2 and report["cpu_target"]["reference_tokens"] == 40


def test_reference_defaults_to_the_same_size_and_the_table_says_so():
    results = bench.run_bench(tokens=64, devices=["cpu"], repeat=1, threads=[1])
    assert all(r.reference.tokens == 64 and not r.reference_capped for r in results)
    table = CliRunner().invoke(cli, ["bench", "--tokens", "64", "--repeat", "1", "--threads", "1"])
    assert table.exit_code == 0, table.output
    assert "reference timed on the same 64 tokens" in table.output and "np.copyto" in table.output
    capped = CliRunner().invoke(cli, ["bench", "--tokens", "64", "--repeat", "1", "--threads", "1",
                                      "--reference-tokens", "32"])
    assert "reference timed on 32 tokens, capped below 64" in capped.output


def test_only_selects_operations_by_name():
    run = CliRunner().invoke(cli, ["bench", "--tokens", "64", "--repeat", "1", "--threads", "1", "--only",
                                   "decode flashmla-model1", "--only", "-> trtllm-fp8 dst_scale", "--json"])
    assert run.exit_code == 0, run.output
    cases = {r["case"].removesuffix(" into out=") for r in json.loads(run.output)["results"]}
    assert cases == {"decode flashmla-model1 -> fp32 latents", "transcode flashmla-model1 -> trtllm-fp8 dst_scale=auto"}
    table = CliRunner().invoke(cli, ["bench", "--tokens", "64", "--repeat", "1", "--threads", "1", "--only",
                                     "decode flashmla-model1"])
    assert table.exit_code == 0 and "x ceil" in table.output and "torch.empty + fill_" in table.output
    none = CliRunner().invoke(cli, ["bench", "--tokens", "64", "--repeat", "1", "--only", "no such operation"])
    assert none.exit_code == 2 and "no benchmarked operation" in none.output


def test_bad_thread_list_is_a_usage_error():
    run = CliRunner().invoke(cli, ["bench", "--threads", "0,x"])
    assert run.exit_code == 2 and "thread counts" in run.output


def test_migrate_bench_local_reports_every_stage_beside_both_copies():
    from kvbridge.migration.bench import bench_local

    res = bench_local(tokens=512, repeat=1)
    assert res["request"]["payload_bytes"] > 0 and res["request"]["loss_report"] is False
    for key in ("np_copyto", "torch_copy_", "gather", "checksum", "verify", "convert", "publish", "migrate_local",
                "transport_path", "transport_pack", "transport_finish", "byte_move"):
        assert res[key]["seconds"] > 0 and res[key]["x_np_copyto"] > 0 and res[key]["x_torch_copy_"] > 0, key
    run = CliRunner().invoke(cli, ["migrate", "bench", "--local", "--tokens", "300", "--repeat", "1", "--json"])
    assert run.exit_code == 0, run.output
    assert json.loads(run.output)["request"]["tokens"] == 300
    refused = CliRunner().invoke(cli, ["migrate", "bench", "--loss-report", "--no-gloo"])
    assert refused.exit_code == 2 and "--local only" in refused.output


def test_migrate_bench_local_to_sglang_with_synthetic_or_file_ape(tmp_path):
    """TensorRT-LLM -> SGLang needs the model's APE weights: seeded stand-ins or a file; the output names them."""
    from safetensors.torch import save_file

    from kvbridge.engines.topology import get_model
    from kvbridge.migration.ape import synthetic_ape
    from kvbridge.migration.bench import bench_local

    res = bench_local(tokens=300, src="trtllm", dst="sglang", repeat=1, loss_report=True, ape="synthetic")
    used = res["request"]["ape"]
    assert used["weights"] == "synthetic" and used["seed"] == 0 and len(used["sha256"]) == 64
    assert res["local_convert_state"]["seconds"] > 0 and res["local_convert_indexer"]["seconds"] > 0
    assert res["local_convert_kv"]["seconds"] > 0
    assert bench_local(tokens=300, repeat=1)["request"]["ape"] is None  # TensorRT-LLM -> vLLM needs none
    path = tmp_path / "ape.safetensors"
    save_file(synthetic_ape(get_model("deepseek-v4-flash"), seed=0), str(path))
    args = ["migrate", "bench", "--local", "--from", "trtllm", "--to", "sglang", "--tokens", "200", "--repeat", "1"]
    run = CliRunner().invoke(cli, [*args, "--ape", str(path), "--json"])
    assert run.exit_code == 0, run.output
    assert json.loads(run.output)["request"]["ape"] == {"weights": "files", "files": [str(path)],
                                                        "sha256": used["sha256"]}  # the same tensors
    table = CliRunner().invoke(cli, [*args, "--ape", "synthetic"])
    assert table.exit_code == 0, table.output
    assert "synthetic APE weights (seed 0)" in table.output and "compressor state" in table.output
    refused = CliRunner().invoke(cli, args)
    assert refused.exit_code != 0 and "--ape FILE" in refused.output
    mixed = CliRunner().invoke(cli, [*args, "--ape", "synthetic", "--ape", str(path)])
    assert mixed.exit_code == 2 and "stands alone" in mixed.output
