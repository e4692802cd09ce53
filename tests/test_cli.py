"""The command line over a data directory the proxy wrote: ls, show, sql, export, config."""

from __future__ import annotations

import json

import click
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from overnight.cli.main import main

from .helpers import needs_vllm, wait_for_rows

SYSTEM = {"role": "system", "content": "Be brief."}


@pytest.fixture
async def data_dir(make_proxy, tmp_path):
    """Three groups written through the proxy: g0 and g1 with 2 rollouts, g2 with 1."""
    proxy = await make_proxy()
    for g in range(3):
        for r in range(2 if g < 2 else 1):
            rollout = f"g{g}.r{r}"
            messages = [SYSTEM, {"role": "user", "content": f"task {g}"}]
            for _turn in range(2):
                body = {"model": "policy", "messages": messages, "max_tokens": 2}
                reply = await (
                    await proxy.post(
                        "/v1/chat/completions",
                        json=body,
                        headers={"X-Rollout-Group": f"g{g}", "X-Rollout-Id": rollout},
                    )
                ).json()
                messages = [
                    *messages,
                    reply["choices"][0]["message"],
                    {"role": "user", "content": "more"},
                ]
            await proxy.post(f"/v1/rollouts/{rollout}/reward", json={"reward": float(r)})
    await proxy.post("/v1/rollouts/g0.r0/finish")
    await wait_for_rows(tmp_path / "data", 10)
    return tmp_path / "data"


def run(*args: str, env: dict | None = None) -> str:
    result = CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def run_failing(*args: str) -> str:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    assert result.exit_code != 0
    assert "Traceback" not in result.output
    return result.output


async def test_ls_lists_groups_and_rollouts(data_dir):
    out = run("ls", "--data", str(data_dir))
    assert out.startswith("3 group(s), 5 rollout(s)")
    assert "group g0: 2 rollout(s), 4 turn(s)" in out and "mean reward 0.500, 1 finished" in out
    line = next(line for line in out.splitlines() if line.strip().startswith("g0.r1"))
    assert line.split()[:2] == ["g0.r1", "2"] and "1.000" in line and "fake-base" in line
    assert run("ls", "--data", str(data_dir), "--group", "g2").count("group g2") == 1


async def test_show_prints_the_conversation_turn_by_turn(data_dir):
    out = run("show", "g1.r0", "--data", str(data_dir))
    assert out.startswith(
        "rollout g1.r0 in group g1: 2 turn(s), reward 0.000 (agent), not finished"
    )
    assert out.count("--- turn") == 2
    assert out.count("[system] Be brief.") == 1  # history is not repeated on later turns
    assert out.count("[user] more") == 1 and out.count("[assistant]  w00 w01") == 2
    assert "no rollout 'nope'" in run_failing("show", "nope", "--data", str(data_dir))


async def test_sql_formats(data_dir):
    q = "SELECT group_id, rollouts FROM groups ORDER BY group_id"
    assert run("sql", q, "--data", str(data_dir)).splitlines()[1:4] == [
        "g0        2",
        "g1        2",
        "g2        1",
    ]
    assert run("sql", q, "--data", str(data_dir), "--format", "csv").splitlines() == [
        "group_id,rollouts",
        "g0,2",
        "g1,2",
        "g2,1",
    ]
    first = json.loads(run("sql", q, "--data", str(data_dir), "--format", "json").splitlines()[0])
    assert first == {"group_id": "g0", "rollouts": 2}
    assert "Parser Error" in run_failing("sql", "SELEC nonsense", "--data", str(data_dir))


async def test_export(data_dir, tmp_path):
    out = tmp_path / "out.parquet"
    assert "wrote 10 row(s) of completions" in run(
        "export", "--data", str(data_dir), "--format", "parquet", "--out", str(out)
    )
    table = pq.read_table(out)
    assert table.num_rows == 10 and "completion_token_ids" in table.column_names
    jsonl = tmp_path / "rollouts.jsonl"
    run("export", "--data", str(data_dir), "--table", "rollouts", "--out", str(jsonl))
    lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert len(lines) == 5 and {line["rollout_id"] for line in lines} >= {"g0.r0", "g2.r0"}


async def test_config_file_then_environment_then_flags(data_dir, tmp_path):
    config = tmp_path / "overnight.toml"
    config.write_text(f'data = "{data_dir}"\n[ls]\nlimit = 1\n')
    assert run("--config", str(config), "ls").count("\ngroup ") == 1
    assert (
        run("--config", str(config), "ls", env={"OVERNIGHT_LS_LIMIT": "2"}).count("\ngroup ") == 2
    )
    assert (
        run("--config", str(config), "ls", "--limit", "3", env={"OVERNIGHT_LS_LIMIT": "2"}).count(
            "\ngroup "
        )
        == 3
    )
    assert run("ls", env={"OVERNIGHT_DATA": str(data_dir)}).startswith("3 group(s)")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[ls]\nlimt = 1\n", "[ls] has no option ['limt']"),
        ("[lss]\nlimit = 1\n", "no command named ['lss']"),
        ("colour = 1\n", "no command has an option ['colour']"),
        ("[ls\n", "cannot read config file"),
    ],
)
def test_bad_config_files_are_explained(tmp_path, text, message):
    config = tmp_path / "bad.toml"
    config.write_text(text)
    assert message in run_failing("--config", str(config), "ls")


def test_missing_data_directory_is_explained(tmp_path):
    assert "no data directory" in run_failing("ls", "--data", str(tmp_path / "nowhere"))


def test_serve_needs_exactly_one_of_model_and_upstream():
    assert "exactly one of --model" in run_failing("serve")
    assert "exactly one of --model" in run_failing(
        "serve", "--model", "m", "--upstream", "http://x"
    )


def test_serve_builds_its_configs_from_the_flags(monkeypatch, tmp_path):
    """Options come from the config fields, defaults included; with --model, vLLM gets a
    port first so that the proxy's upstream is its URL."""
    import overnight.cli.serve
    from overnight.config import ProxyConfig, VLLMConfig

    seen = []
    monkeypatch.setattr(overnight.cli.serve, "serve_forever", lambda *args, **kw: seen.append(args))
    run("serve", "--upstream", "http://127.0.0.1:9/v1", "--data", str(tmp_path), "--port", "9001")
    proxy, vllm, host, port = seen.pop()
    # `--upstream-kind auto` asked the upstream once; nothing answered: vLLM, as always.
    assert proxy == ProxyConfig(
        upstream="http://127.0.0.1:9", data_dir=tmp_path, upstream_kind="vllm"
    )
    assert (vllm, host, port) == (None, "127.0.0.1", 9001)
    data = str(tmp_path)
    run("serve", "--model", "m", "--vllm-arg=--dtype=float32", "--data", data)
    proxy, vllm, _, _ = seen.pop()
    assert vllm.port and proxy.upstream == vllm.url
    log_path = tmp_path / "logs" / "vllm.log"
    assert vllm == VLLMConfig(
        model="m", port=vllm.port, extra_args=("--dtype=float32",), log_path=log_path
    )
    # The project's own errors are one line, not a traceback.
    assert "upstream must be an http(s) URL" in run_failing("serve", "--upstream", "ftp://x")


def test_train_and_judge_build_their_configs(monkeypatch, tmp_path):
    """--preset fills only what no flag, variable or file gave; the judge step is shared."""
    import overnight.judge.run
    import overnight.trainer.train
    from overnight.config import JudgeConfig, TrainConfig

    trained, judged = [], []
    monkeypatch.setattr(overnight.trainer.train, "train", lambda _, c, **kw: trained.append(c))
    monkeypatch.setattr(
        overnight.judge.run, "judge_step", lambda _, c, reward, **kw: judged.append((c, reward, kw))
    )
    data = str(tmp_path)
    run("train", "--data", data, "--dry-run")
    assert trained.pop() == TrainConfig()
    run(
        "train", "--data", data, "--dry-run", "--preset", "tiny-cpu", "--lora-rank", "4",
        "--dual-clip", "0", "--target-module", "q_proj",
        env={"OVERNIGHT_TRAIN_EPOCHS": "2"},
    )  # fmt: skip
    assert trained.pop() == TrainConfig(
        learning_rate=6e-2, epochs=2, lora_rank=4, lora_alpha=8, dual_clip=None,
        target_modules=("q_proj",),
    )  # fmt: skip
    run("train", "--data", data, "--judge-model", "j", "--judge-base-url", "http://h/v1")
    assert judged.pop() == (
        JudgeConfig(model="j", base_url="http://h/v1"),
        None,
        {
            "say": click.echo,
            "settle_seconds": 600.0,
            "scope": None,  # no proxy: every group, as before policies
            "tool_call_parser": "hermes",
            "tool_parser_tokenizer": None,
        },
    )
    # Siblings' tool calls are read with the server's parser, with the base model's
    # tokenizer unless another is named.
    run("train", "--data", data, "--reward", "examples/rewards.py:weather_reward", "--tool-call-parser", "pythonic",
        "--base-model", "/models/m")  # fmt: skip
    _, _, how = judged.pop()
    assert (how["tool_call_parser"], how["tool_parser_tokenizer"]) == ("pythonic", "/models/m")
    rubric = tmp_path / "rubric.txt"
    rubric.write_text("shorter is better")
    run("judge", "--data", data, "--judge-model", "j", "--rubric", str(rubric), "--max-tokens", "9")
    config, reward, how = judged.pop()
    assert config == JudgeConfig(model="j", rubric="shorter is better", max_tokens=9)
    assert reward is None and how["use_posted"] and how["groups"] is None
    assert (how["tool_call_parser"], how["tool_parser_tokenizer"]) == ("hermes", None)


@needs_vllm
def test_a_tool_call_parser_vllm_lacks_stops_the_night_before_any_sampling(monkeypatch, tmp_path):
    import overnight.trainer.choose.resample

    sampled = []
    monkeypatch.setattr(
        overnight.trainer.choose.resample, "resample_turns", lambda *a, **k: sampled.append(1)
    )
    out = run_failing(
        "train", "--data", str(tmp_path), "--resample", "2", "--reward", "examples/rewards.py:weather_reward",
        "--tool-call-parser", "no-such-parser",
    )  # fmt: skip
    assert "vLLM has no tool call parser 'no-such-parser'" in out and "hermes" in out
    assert sampled == []
