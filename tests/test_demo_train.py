"""The demo model's training script (bench/demo_kit/train.py) is deterministic; generation_config.json's
max_new_tokens is the default reply length; the CLI's first-run polish; CI runs the README's test command."""
from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys

from radixserve.bench.demo_kit.data import Generator
from radixserve.bench.demo_kit.train import Encoder, TrainConfig, batches, train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A few steps of a tiny model over the real corpus: seconds, not the shipped run's minutes. Plain fp32 eager with
# assistant tokens only (each speed option and the prompt loss are turned on by the test about it).
SHORT = TrainConfig(steps=3, samples_per_step=6, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                    intermediate_size=128, warmup_steps=1, prompt_loss_weight=0.0, bucket_ratio=0.0, bf16=False,
                    compile=False, shape_multiple=1)


def _weights(path: str) -> bytes:
    with open(os.path.join(path, "model.safetensors"), "rb") as f:
        return f.read()


def test_training_is_deterministic_for_a_fixed_thread_count(tmp_path):
    a = train(SHORT, str(tmp_path / "a"), threads=1, log=lambda line: None)
    b = train(SHORT, str(tmp_path / "b"), threads=1, log=lambda line: None)
    assert _weights(str(tmp_path / "a")) == _weights(str(tmp_path / "b"))
    assert a["final_loss"] == b["final_loss"]
    other = TrainConfig(**{**SHORT.__dict__, "seed": 1})
    train(other, str(tmp_path / "c"), threads=1, log=lambda line: None)
    assert _weights(str(tmp_path / "c")) != _weights(str(tmp_path / "a"))  # the seed matters: the test can fail
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert os.path.isfile(tmp_path / "a" / name)


def _twice_and_plain(cfg: TrainConfig, tmp_path) -> tuple[bytes, bytes, bytes]:
    """The weights of two runs of cfg and of one SHORT run."""
    for name, run in (("a", cfg), ("b", cfg), ("plain", SHORT)):
        train(run, str(tmp_path / name), threads=1, log=lambda line: None)
    return tuple(_weights(str(tmp_path / name)) for name in ("a", "b", "plain"))


def test_prompt_loss_weight_trains_on_prompts_too_and_stays_deterministic(tmp_path):
    a, b, plain = _twice_and_plain(TrainConfig(**{**SHORT.__dict__, "prompt_loss_weight": 0.25}), tmp_path)
    assert a == b
    assert a != plain  # the prompt tokens count


def test_the_shipped_runs_speed_options_stay_deterministic(tmp_path):
    """bf16 autocast, torch.compile, bucketing and shape rounding as the shipped run has them (the first compile
    takes most of this test's ~45 s)."""
    shipped = TrainConfig()
    fast = TrainConfig(**{**SHORT.__dict__, **{k: getattr(shipped, k) for k in
                                              ("bf16", "compile", "shape_multiple", "bucket_ratio")}})
    assert fast.bf16 and fast.compile and fast.shape_multiple > 1 and fast.bucket_ratio
    a, b, plain = _twice_and_plain(fast, tmp_path)
    assert a == b
    assert a != plain  # the options really ran


def test_micro_batches_bucket_by_length_round_shapes_and_keep_every_sample(tmp_path):
    from radixserve.bench.demo_kit.tokenizer import build_tokenizer

    build_tokenizer(str(tmp_path), 2048)
    encoder = Encoder(str(tmp_path))
    for ratio, multiple in ((0.0, 1), (1.5, 32)):
        cfg = TrainConfig(samples_per_step=32, bucket_ratio=ratio, shape_multiple=multiple)
        stream, expected = batches(encoder, cfg), Generator(cfg.seed)
        for _ in range(5):
            lengths = sorted(n for n in (len(encoder.encode(expected.sample())[0]) for _ in range(32))
                             if n <= cfg.max_len)
            micro = next(stream)
            got = sorted(int((labels != -100).sum(dim=1)[row]) for _, labels, _ in micro for row in range(len(labels)))
            assert got == lengths  # every sample of the step, once, unchanged
            for ids, labels, weights in micro:
                real = (labels != -100).sum(dim=1)
                assert ids.shape[1] % multiple == 0 and ids.shape[1] - int(real.max()) < multiple
                assert len(ids) * int(real.max()) <= cfg.tokens_per_micro_batch
                assert not ratio or int(real.max()) <= ratio * int(real.min())
                assert bool((weights[labels == -100] == 0).all())  # padding never weighs


def test_loss_sees_assistant_turns_only(tmp_path):
    from radixserve.bench.demo_kit.tokenizer import build_tokenizer

    build_tokenizer(str(tmp_path), 2048)
    encoder = Encoder(str(tmp_path))
    gen = Generator(0)
    for _ in range(200):
        sample = gen.sample()
        ids, flags = encoder.encode(sample)
        trained = encoder.rust.decode([t for t, f in zip(ids, flags) if f], skip_special_tokens=False)
        if sample.text is not None:
            assert trained == sample.text + "<|endoftext|>"
            continue
        assert "<|im_start|>" not in trained and "<tool_response>" not in trained and "Observation" not in trained
        assert trained.endswith("<|im_end|>")


def test_generation_config_max_new_tokens_is_the_default(tmp_path):
    from radixserve.scheduler.sampling_params import SamplingParams
    from radixserve.scheduler.tokenizer import generation_max_new_tokens

    assert SamplingParams.from_any(None, 40).max_new_tokens == 40
    assert SamplingParams.from_any({"temperature": 0.5}, 40).max_new_tokens == 40
    assert SamplingParams.from_any({"max_new_tokens": 7}, 40).max_new_tokens == 7
    assert SamplingParams.from_any(None).max_new_tokens == SamplingParams().max_new_tokens
    path = tmp_path / "generation_config.json"
    assert generation_max_new_tokens(str(tmp_path)) is None  # no file
    for value, expected in ((99, 99), (0, None), ("12", None), (True, None)):
        path.write_text(json.dumps({"max_new_tokens": value}))
        assert generation_max_new_tokens(str(tmp_path)) == expected


def test_chat_template_flag_and_the_missing_template_warning(tmp_path, caplog):
    from radixserve.frontend.server import _use_chat_template
    from radixserve.bench.checkpoints import cached_checkpoint
    from radixserve.scheduler.tokenizer import Tokenizer

    import shutil

    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(cached_checkpoint("llama", vocab_size=512, hidden_size=64, num_layers=2, num_heads=4,
                                      num_kv_heads=2, intermediate_size=128, max_position_embeddings=1024, seed=3),
                    ckpt)
    config_path = os.path.join(ckpt, "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f)
    del config["chat_template"]
    with open(config_path, "w") as f:
        json.dump(config, f)
    tok = Tokenizer(ckpt)
    with caplog.at_level(logging.WARNING, logger="radixserve.frontend.server"):
        _use_chat_template(tok, None)
    assert "has no chat template" in caplog.text and "--chat-template" in caplog.text
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    _use_chat_template(tok, str(template))
    assert tok.render_chat([{"role": "user", "content": "hi"}], add_generation_prompt=False) == "[user] hi\n"


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "radixserve.frontend.cli", *args], capture_output=True, text=True,
                          timeout=120)


def test_cli_alone_lists_commands_and_has_a_version():
    bare = _cli()
    assert bare.returncode == 0 and "serve" in bare.stdout and "HTTP server" in bare.stdout
    version = _cli("--version")
    assert version.returncode == 0 and re.fullmatch(r"radixserve \S+\n", version.stdout)
    help_text = _cli("serve", "--help").stdout
    assert "examples:" in help_text and "16384 on the CPU" in " ".join(help_text.split())
    hub = _cli("serve", "--model", "Qwen/Qwen2.5-0.5B-Instruct")
    assert hub.returncode == 2 and "looks like a Hugging Face hub id" in hub.stderr


def test_ci_runs_the_readme_test_command():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    commands = [line.strip() for line in readme.splitlines() if line.startswith("    ") and "pytest" in line]
    assert len(commands) == 1, commands  # the README's one test command
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
        ci = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    assert commands[0] in ci, (commands[0], ci)
    assert os.access(os.path.join(ROOT, ".ci", "run"), os.X_OK)


def test_readme_torch_floor_matches_pyproject():
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
        floor = re.search(r'"torch>=([\d.]+)"', f.read()).group(1)
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    assert re.findall(r"`torch>=([\d.]+)`", readme) == [floor]
