"""The harness's own pieces, in the fast loop (`make test`; the suite itself is `make test-trl-suite`): the Zen
datasets match the hub's, the byte symbols sit at GPT-2's ids, the modes fix `conditioning` and nothing else."""

from __future__ import annotations

import tiny_hub


def test_zen_datasets_have_the_hub_splits_and_prompts():
    train = tiny_hub.load_dataset("trl-internal-testing/zen", "standard_prompt_only", split="train")
    both = tiny_hub.load_dataset("trl-internal-testing/zen", "conversational_prompt_only")
    assert (len(train), len(both["train"]), len(both["test"])) == (17, 17, 2)
    assert train["prompt"][:4] == ["Beautiful is better than", "Explicit is", "Simple is better", "Complex"]
    assert both["test"][0]["prompt"][0]["role"] == "user"
    stream = tiny_hub.load_dataset("trl-internal-testing/zen", "standard_prompt_only", split="test", streaming=True)
    assert [r["prompt"] for r in stream] == ["If the implementation is easy", "Namespaces are one honking great"]


def test_byte_symbols_sit_at_gpt2_ids():
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    gpt2 = bytes_to_unicode()  # byte -> symbol, in GPT-2's vocabulary order
    assert list(tiny_hub.byte_alphabet()) == list(gpt2.values())
    for i, text in tiny_hub.QWEN_PINNED.items():
        if len(text.encode()) == 1:
            assert tiny_hub.byte_alphabet()[i] == tiny_hub.to_byte_level(text), (i, text)


def test_modes_fix_conditioning_and_pass_everything_else():
    from modes import mode_classes
    from trl import GRPOConfig, GRPOTrainer

    assert mode_classes("baseline") == (GRPOTrainer, GRPOConfig)
    for mode in ("none", "rc"):
        trainer, config = mode_classes(mode)
        args = config(output_dir="unused", learning_rate=0.25, report_to="none", use_cpu=True)
        assert (args.conditioning, args.learning_rate) == (mode, 0.25)
        assert trainer.__name__ == f"RCGRPOTrainer_{mode}" and trainer.__module__ == "modes"
