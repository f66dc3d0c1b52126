"""The reward goal's place: `sft.reward_goal_place: answer` saves a chat template that renders the goal's token
as the first token of the first answer, and every consumer of the model (training masks, rollouts) sees it
there; chats without a goal render exactly as before."""

from __future__ import annotations

import pytest
from helpers import HIGH, LEVELS, LOW, chat, compute_from_params, resolved, tiny_sft_config

from rcgrpo_tasks.data.chat import answer_goal_template, assistant_token_mask, goal_place
from rcgrpo_tasks.engine.rollout import ChatRenderer
from rcgrpo_tasks.ops.config import ConfigError
from rcgrpo_tasks.ops.outputs import write_jsonl
from rcgrpo_tasks.train.sft import config as sft_config
from rcgrpo_tasks.train.sft import run as sft_run
from rcgrpo_tasks.train.sft import trainer as sft_trainer


@pytest.fixture()
def answer_tok(tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.add_special_tokens({"extra_special_tokens": list(LEVELS)}, replace_extra_special_tokens=False)
    plain = tok.chat_template
    tok.chat_template = answer_goal_template(plain)
    return tok, plain


def test_the_goal_token_opens_the_first_answer_and_stays_out_of_the_loss(answer_tok):
    tok, plain = answer_tok
    messages = chat(3, HIGH)["messages"]
    text = tok.apply_chat_template(messages, tokenize=False)
    assert "[Reward Goal:" not in text and text.count(HIGH) == 1
    assert f"<|im_start|>assistant\n{HIGH}[add(a=3, b=3)]<|im_end|>" in text
    assert "<|im_start|>assistant\n[done()]<|im_end|>" in text  # the second answer: no token
    assert "then say done.<|im_end|>" in text  # the user message lost its goal text
    prompt = tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith(f"<|im_start|>assistant\n{HIGH}") and text.startswith(prompt)
    ids, mask = assistant_token_mask(tok, messages)
    at = ids.index(tok.convert_tokens_to_ids(HIGH))
    assert mask[at] == 0 and mask[at + 1] == 1
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "[add(a=3, b=3)]<|im_end|>[done()]<|im_end|>"
    assert goal_place(tok) == "answer" and answer_goal_template(tok.chat_template) == tok.chat_template


def test_chats_without_a_goal_render_as_under_the_plain_template(answer_tok):
    tok, plain = answer_tok
    messages = chat(5, None)["messages"]
    for upto, gen in ((messages, False), (messages[:2], True), (messages[:2], False)):
        assert (tok.apply_chat_template(upto, tokenize=False, add_generation_prompt=gen)
                == tok.apply_chat_template(upto, tokenize=False, add_generation_prompt=gen, chat_template=plain))


def test_the_rollout_prompt_ends_with_the_goal_token(answer_tok):
    tok, _ = answer_tok
    renderer = ChatRenderer(tok)
    ids = renderer.ids(renderer.text(chat(2, LOW)["messages"][:2], True))
    assert ids[-1] == tok.convert_tokens_to_ids(LOW)
    assert ids[:-1] == renderer.ids(renderer.text(chat(2, None)["messages"][:2], True))


def test_rctp_with_answer_place_saves_the_template_and_trains_without_the_token_in_the_loss(tiny_model_dir,
                                                                                          tmp_path):
    from transformers import AutoTokenizer

    data = tmp_path / "rctp.jsonl"
    write_jsonl(data, [chat(i, HIGH if i % 2 else LOW) for i in range(8)])
    cfg = tiny_sft_config(reward_goal_place="answer", max_steps=1, require_reward_token=True)
    trainer = sft_trainer.build_trainer(resolved(cfg), tiny_model_dir, sft_rows_of(data), LEVELS, tmp_path / "ck")
    tok, ex = trainer.processing_class, trainer.train_dataset[0]
    learned = tok.decode([i for i, lab in zip(ex["input_ids"], ex["labels"]) if lab != -100])
    assert learned == "[add(a=0, b=0)]<|im_end|>[done()]<|im_end|>"
    assert tok.convert_tokens_to_ids(LOW) in ex["input_ids"]
    run = sft_config.SftRun("rctp", tiny_model_dir, data, tmp_path / "out", tmp_path / "ckpt2",
                          tmp_path / "m.json", tmp_path / "m.tsv")
    sft_run.train_variant(cfg, LEVELS, run, track=False, compute=compute_from_params())
    assert goal_place(AutoTokenizer.from_pretrained(run.out)) == "answer"


def test_a_user_place_run_refuses_a_start_that_renders_the_goal_before_the_answer(tiny_model_dir, tmp_path):
    import shutil

    from transformers import AutoTokenizer

    start = tmp_path / "start"
    shutil.copytree(tiny_model_dir, start)
    tok = AutoTokenizer.from_pretrained(start)
    tok.chat_template = answer_goal_template(tok.chat_template)
    tok.save_pretrained(start)
    with pytest.raises(ConfigError, match="reward_goal_place: user"):
        sft_trainer.build_trainer(resolved(tiny_sft_config()), start, [chat(0, LOW)], LEVELS, tmp_path / "ck")


def test_the_place_is_checked():
    with pytest.raises(ValueError, match=r"sft.reward_goal_place: expected .*'user', 'answer'"):
        tiny_sft_config(reward_goal_place="system")


def sft_rows_of(path):
    from rcgrpo_tasks.train.sft import rows as sft_rows

    return sft_rows.load_rows(path, LEVELS, True)
