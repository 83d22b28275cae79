"""The shipped demo model: loads with transformers, answers in format; the task is sound."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from sprig.runtime.demo import DEMO_MODEL_PATH, ensure_demo_model, mixture, tasks
from sprig.runtime.demo.chat_format import CHAT_TEMPLATE


def test_generator_is_deterministic():
    assert tasks.take("train", 50, seed=3) == tasks.take("train", 50, seed=3)
    assert tasks.take("train", 50, seed=3) != tasks.take("train", 50, seed=4)


def test_splits_never_overlap():
    train = {p.question for p in tasks.take("train", 5000)}
    heldout = {p.question for p in tasks.take("heldout", 500)}
    assert not train & heldout
    assert all(tasks.split_of(q) == "heldout" for q in heldout)


def test_solution_ends_with_its_answer():
    for p in tasks.take("heldout", 200):
        assert tasks.extract_answer(p.solution) == p.answer
        assert 0 <= p.answer <= tasks.MAX_VALUE
        assert 1 <= p.solution.count("=") <= 8


EQUATION = re.compile(r"^(\d+) ([-+*/]) (\d+) = (\d+)$")
OPS = {"+": int.__add__, "-": int.__sub__, "*": int.__mul__, "/": int.__floordiv__}


def test_every_equation_holds_and_chains_to_the_answer():
    for p in tasks.take("train", 500):
        *lines, answer_line = p.solution.split("\n")
        value = int(re.search(r"has (\d+) ", p.question).group(1))
        for line in lines:
            a, op, b, c = EQUATION.match(line).groups()
            assert int(a) == value, (p.solution, line)
            assert OPS[op](int(a), int(b)) == int(c), line
            if op == "/":
                assert int(a) % int(b) == 0, line
            value = int(c)
        assert answer_line == f"Answer: {value}" and value == p.answer


def test_an_operation_is_worked_in_several_ways():
    """Buying n >= 10 (not a multiple of 10) is added directly, tens first, or units first,
    about equally often; doubling is `* 2` or a sum."""
    ways: Counter[str] = Counter()
    for p in tasks.take("train", 3000):
        m = re.search(r"has (\d+) \w+\. Then \w+ buys (\d+) more\.", p.question)
        if m and int(m.group(2)) >= 10 and int(m.group(2)) % 10:
            a, n = int(m.group(1)), int(m.group(2))
            first = p.solution.split("\n")[0]
            way = {f"{a} + {n}": "direct", f"{a} + {n - n % 10}": "tens", f"{a} + {n % 10}": "units"}
            ways[way[first.split(" =")[0]]] += 1  # any other first line is a KeyError
        if re.search(r"has \d+ \w+\. Then \w+ doubles", p.question):
            ways["* 2" if " * 2 = " in p.solution.split("\n")[0] else "a + a"] += 1
    total = ways["direct"] + ways["tens"] + ways["units"]
    assert total > 100 and all(ways[w] > total / 5 for w in ("direct", "tens", "units")), ways
    assert ways["* 2"] > 10 and ways["a + a"] > 10, ways


@pytest.mark.parametrize(
    ("text", "answer"),
    [("3 + 4 = 7\nAnswer: 7", 7), ("Answer: 12\n", 12), ("Answer: 5 then more", None), ("7", None)],
)
def test_extract_answer(text, answer):
    assert tasks.extract_answer(text) == answer


def test_checkpoint_is_small():
    size = sum(f.stat().st_size for f in ensure_demo_model().iterdir())
    assert size <= 25 * 2**20


def test_greedy_output_ends_with_an_answer_line():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sprig.runtime.demo.evaluate import generate

    tok = AutoTokenizer.from_pretrained(DEMO_MODEL_PATH)
    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL_PATH).eval()
    assert tok.eos_token == "<|end|>" and model.generation_config.eos_token_id == tok.eos_token_id
    problems = tasks.take("heldout", 4)
    for text in generate(model, tok, problems):
        assert isinstance(tasks.extract_answer(text[0]), int), text


def _training_script():
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "train_demo_model.py"
    spec = importlib.util.spec_from_file_location("train_demo_model", path)
    train = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = train  # its dataclasses look themselves up
    spec.loader.exec_module(train)
    return train


@pytest.fixture(scope="module")
def train():
    return _training_script()


@pytest.fixture(scope="module")
def tok():
    """The shipped tokenizer with the chat template the training script writes."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(DEMO_MODEL_PATH)
    tok.chat_template = CHAT_TEMPLATE
    return tok


@pytest.mark.parametrize("prompt_weight", [0.0, 1.0])
def test_training_loss_equals_one_example_per_row(train, tok, prompt_weight):
    """The training script batches dialogues of similar length together, each group its own
    padded tensor; loss and gradients must be those of padding every dialogue to one
    batch-wide row (nothing attends to padding or across dialogues), with the loss on the
    assistant's tokens, or (prompt weight 1) on every token; and so for a dialogue alone."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    examples = train.encode(tok, mixture.take("train", 24))
    groups = train.length_groups(examples)
    assert 1 < len(groups) < len(examples)
    assert sorted(map(id, examples)) == sorted(id(e) for g in groups for e in g)
    for group in groups:
        lengths = [len(ids) for ids, _, _ in group]
        assert max(lengths) <= train.GROUP_SPREAD * min(lengths)

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, pad_token_id=tok.pad_token_id,
    )
    model = LlamaForCausalLM(config)

    def loss_and_grads(loss: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
        model.zero_grad()
        loss.backward()
        return loss.item(), [p.grad.clone() for p in model.parameters()]

    width = max(len(ids) for ids, _, _ in examples)
    padded = torch.full((len(examples), width), tok.pad_token_id)
    labels = torch.full((len(examples), width), -100)
    for row, (ids, target, _) in enumerate(examples):
        padded[row, : len(ids)] = torch.tensor(ids)
        labels[row, : len(ids)] = torch.tensor(target if prompt_weight == 0 else ids)
    want, want_grads = loss_and_grads(model(input_ids=padded, labels=labels).loss)
    got, got_grads = loss_and_grads(train.batch_loss(train.TargetLoss(model), examples, tok.pad_token_id,
                                                     prompt_weight))
    assert got == pytest.approx(want, abs=1e-5)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)

    ids, target, _ = examples[0]  # a group of one, which batch_loss pads with a row of padding alone
    want, want_grads = loss_and_grads(model(input_ids=torch.tensor([ids]),
                                            labels=torch.tensor([target if prompt_weight == 0 else ids])).loss)
    got, got_grads = loss_and_grads(train.batch_loss(train.TargetLoss(model), examples[:1], tok.pad_token_id,
                                                     prompt_weight))
    assert got == pytest.approx(want, abs=1e-5)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)


def test_task_weights_scale_each_tasks_turns_in_the_training_loss(train, tok):
    """`--task-weights` multiplies the loss weight of a task's assistant tokens: the training
    loss and its gradients are the weighted mean over the dialogues padded one per row, and
    a malformed value is refused before training starts."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    weights = train.parse_task_weights("few-shot=2.5, tools=0.5")
    assert weights == {"few-shot": 2.5, "tools": 0.5}
    dialogues = mixture.take("train", 24)
    examples = train.encode(tok, dialogues, weights)
    assert [w for _, _, w in examples] == [weights.get(d.task, 1.0) for d in dialogues]
    assert {d.task for d in dialogues} >= {"few-shot", "tools", "json"}

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=tok.pad_token_id)
    model = LlamaForCausalLM(config)

    def loss_and_grads(loss: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
        model.zero_grad()
        loss.backward()
        return loss.item(), [p.grad.clone() for p in model.parameters()]

    total, norm = torch.zeros(()), 0.0
    for ids, labels, weight in examples:  # one dialogue at a time, no padding
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
        on = torch.tensor(labels[1:]) != -100
        total = total + weight * torch.nn.functional.cross_entropy(logits[on], torch.tensor(ids[1:])[on],
                                                                   reduction="sum")
        norm += weight * int(on.sum())
    want, want_grads = loss_and_grads(total / norm)
    got, got_grads = loss_and_grads(train.batch_loss(train.TargetLoss(model), examples, tok.pad_token_id))
    assert got == pytest.approx(want, abs=1e-5)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)
    _, plain_grads = loss_and_grads(train.batch_loss(train.TargetLoss(model),
                                                      [(i, lab, 1.0) for i, lab, _ in examples], tok.pad_token_id))
    assert not all(torch.allclose(g, p, atol=1e-5, rtol=1e-4) for g, p in zip(got_grads, plain_grads, strict=True))

    for bad, match in [("few_shot=2", "not a task"), ("few-shot", "TASK=WEIGHT"), ("tools=0", "positive"),
                       ("json=inf", "positive")]:
        with pytest.raises(ValueError, match=match):
            train.TrainConfig(task_weights=bad)


def test_training_copies_first_then_runs_the_mixture(train):
    """The warm-up's `copy_steps` batches come first, then every mixture batch in order,
    and the learning-rate schedule spans both phases."""
    cfg = train.TrainConfig(steps=320, batch_size=2, copy_steps=3, copy_batch_size=4)
    copies, data = [([i], [i]) for i in range(12)], [([100 + i], [100 + i]) for i in range(640)]
    batches = [train.batch_at(s, cfg, copies, data) for s in range(cfg.total_steps)]
    assert [len(b) for b in batches[:3]] == [4, 4, 4] and [e for b in batches[:3] for e in b] == copies
    assert [e for b in batches[3:] for e in b] == data and cfg.total_steps == 323
    assert train.lr_at(cfg.total_steps - 1, cfg) < cfg.lr == train.lr_at(cfg.total_steps - cfg.decay, cfg)


def test_the_last_no_arithmetic_steps_train_on_the_other_tasks_alone(train):
    """`no_arithmetic_steps` changes only the mixture's last steps: the batches before them
    are the plain run's, and theirs hold no arithmetic."""
    plain = train.training_dialogues(train.TrainConfig(steps=320, batch_size=4))
    late = train.training_dialogues(train.TrainConfig(steps=320, batch_size=4, no_arithmetic_steps=20))
    assert late[:300 * 4] == plain[:300 * 4] and len(late) == len(plain)
    assert {d.task for d in late[300 * 4:]} == set(mixture.TASKS) - {"arithmetic"}
    assert any(d.task == "arithmetic" for d in plain[300 * 4:])
    with pytest.raises(ValueError, match="no_arithmetic_steps"):
        train.TrainConfig(steps=320, no_arithmetic_steps=321)


def test_bf16_autocast_follows_the_flag_and_auto_follows_this_cpus_matmul_speed(train, monkeypatch):
    """`--bf16 on/off` decide alone; "auto" keeps autocast unless a bfloat16 matmul is more
    than `BF16_MAX_SLOWDOWN` times slower than float32 (AVX2-only CPUs: ~30x), and says why;
    any other value is refused before training starts."""
    monkeypatch.setattr(train, "bf16_slowdown", lambda hidden: pytest.fail("measured without auto"))
    assert train.use_bf16("on", 64)[0] is True and train.use_bf16("off", 64)[0] is False
    monkeypatch.setattr(train, "bf16_slowdown", lambda hidden: 30.0)
    on, why = train.use_bf16("auto", 64)
    assert not on and "30x" in why and "float32" in why
    monkeypatch.setattr(train, "bf16_slowdown", lambda hidden: 0.8)
    assert train.use_bf16("auto", 64) == (True, "bfloat16 autocast on: a bfloat16 matmul takes 0.80x float32's "
                                                "time on this CPU")
    with pytest.raises(ValueError, match="--bf16"):
        train.TrainConfig(bf16="true")


def test_a_word_is_the_same_tokens_wherever_it_stands(train):
    """With word tokens a name reads the same at a line's start, after a space and inside
    JSON quotes (a space before it is a token of its own), so copying it from the prompt
    is copying the same ids."""
    corpus = [train.render_plain(d) for d in mixture.take("train", 2000)]
    tok = train.build_tokenizer(corpus, 1024, word_tokens=True)

    def ids(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    for word in ("Olga", "Porto", "Tara", "Brouzai"):
        assert ids(f"{word} is 30.")[: len(ids(word))] == ids(word)
        assert ids(f"is {word}?") == ids("is") + ids(" ") + ids(word) + ids("?")
        assert ids(f'"{word}"') == ids('"') + ids(word) + ids('"')


def test_loss_falls_on_every_assistant_turn_and_nothing_else(train, tok):
    """The labelled tokens of a dialogue decode to its assistant turns, each closed by
    `<|end|>`; and each turn starts where the template's prompt for it ends."""
    assert train.encode(tok, []) == []  # --copy-steps 0: no warm-up batches
    for task in mixture.TASKS:
        dialogues = mixture.take_task(task, "train", 30)
        for d, (ids, labels, _) in zip(dialogues, train.encode(tok, dialogues), strict=True):
            text = train.render(tok, d)
            turns = train.target_spans(text)
            assert tok.decode([i for i, x in zip(ids, labels, strict=True) if x != -100]) == "".join(
                text[a:b] for a, b in turns)
            assert len(turns) == len(d.assistant_turns())
            for (a, _), i in zip(turns, d.assistant_turns(), strict=True):
                prompt = tok.apply_chat_template(list(d.messages[:i]), tools=list(d.tools) if d.tools else None,
                                                 add_generation_prompt=True, tokenize=False)
                assert text.startswith(prompt) and len(prompt) == a, (task, i)


def test_verifier_scores_every_worked_solution_sound():
    from sprig.runtime.demo.verify import step_value

    for p in tasks.take("train", 400):
        steps = p.solution.split("\n")
        assert step_value(p.question, steps) == 1.5, p
        for k in range(1, len(steps)):
            assert step_value(p.question, steps[:k]) == 1.0, (p, k)


def test_verifier_marks_down_each_kind_of_slip():
    from sprig.runtime.demo.verify import step_value

    q = "Hana has 6 cards. Then Hana buys 27 more. Then Hana shares them equally with 2 friends and keeps one share. How many cards does Hana have now?"
    good = ["6 + 20 = 26", "26 + 7 = 33", "33 / 3 = 11", "Answer: 11"]
    assert step_value(q, good) == 1.5
    slips = {
        "wrong arithmetic": ["6 + 20 = 25", "25 + 7 = 32"],
        "not from the question's start": ["62 * 2 = 124"],
        "breaks the chain": ["6 + 27 = 33", "30 / 3 = 10"],
        "a number the question never names": ["6 + 41 = 47"],
        "takes away a value the chain held": ["6 + 27 = 33", "33 - 6 = 27"],
        "multiplies by a named number": ["6 * 27 = 162"],
        "no equation": ["Hana has cards"],
    }
    for name, steps in slips.items():
        assert step_value(q, steps) < 1.0, name
    assert step_value(q, [*good[:3], "Answer: 12"]) < 1.0  # answers what the chain did not reach
    assert step_value(q, ["6 * 3 = 18"]) == 1.0  # tripling needs no number from the question


def test_frontend_roles_encode_to_the_training_prompt():
    """`user(q) + assistant_begin()` from a frontend (roles derived from the chat template,
    without `<s>`) and `evaluate.prompts` encode, as a server encodes text, to exactly the
    ids the model was trained on: the tokenizer adds `<s>`."""
    from transformers import AutoTokenizer

    from sprig.runtime.demo.evaluate import prompts
    from sprig.template_source import from_jinja

    tok = AutoTokenizer.from_pretrained(DEMO_MODEL_PATH)
    roles = from_jinja(tok.chat_template, bos_token=tok.bos_token).roles
    problem = tasks.take("heldout", 1)[0]
    trained = tok.encode(
        tok.apply_chat_template(problem.messages()[:1], add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )
    frontend = roles["user"][0] + problem.question + roles["user"][1] + roles["assistant"][0]
    assert trained[0] == tok.bos_token_id and trained.count(tok.bos_token_id) == 1
    assert tok.encode(frontend) == trained
    assert tok.encode(prompts(tok, [problem])[0]) == trained
