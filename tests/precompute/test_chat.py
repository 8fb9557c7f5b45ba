"""Rendering TRL conversational rows with the chat template: the split, special tokens, every refusal."""

import copy

import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from klpipe.precompute.chat import ChatError, ChatRenderer
from tests.helpers import CONVERSATIONAL, TINY_GEMMA

BOS = 2
USER = [{"role": "user", "content": "What is the capital of Australia?"}]
ANSWER = [{"role": "assistant", "content": "Canberra."}]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TINY_GEMMA)


def with_template(tokenizer, template):
    other = copy.deepcopy(tokenizer)
    other.chat_template = template
    return other


def render(tokenizer, prompts, completions):
    """(prompt ids, response ids) per row; every mask all 1, as rows without tool messages have."""
    prompt_lists, response_lists, masks = ChatRenderer(tokenizer, "prompt", "completion").render(prompts, completions)
    for response, mask in zip(response_lists, masks, strict=True):
        assert mask.dtype == bool and len(mask) == len(response) and mask.all()
    return prompt_lists, response_lists


def fails(tokenizer, prompts, completions) -> tuple[int, str]:
    with pytest.raises(ChatError) as excinfo:
        render(tokenizer, prompts, completions)
    return excinfo.value.row, str(excinfo.value)


def test_the_split_is_the_templates_own_tokenization_of_the_whole_conversation(tokenizer):
    rows = pq.read_table(CONVERSATIONAL).to_pylist()
    prompts, completions = [r["prompt"] for r in rows], [r["completion"] for r in rows]
    prompt_lists, response_lists = render(tokenizer, prompts, completions)
    for prompt, completion, prompt_ids, response_ids in zip(prompts, completions, prompt_lists, response_lists,
                                                            strict=True):
        whole = tokenizer.apply_chat_template(prompt + completion, tokenize=True, return_dict=True)["input_ids"]
        alone = tokenizer.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True,
                                              return_dict=True)["input_ids"]
        assert prompt_ids + response_ids == whole
        assert prompt_ids == alone
        assert response_ids  # at least the end-of-turn markup
    # The sample file covers a system message and a multi-turn prompt.
    assert {m["role"] for r in rows for m in r["prompt"]} == {"system", "user", "assistant"}


def test_the_templates_bos_is_not_doubled(tokenizer):
    # The template writes <bos> itself, and the tokenizer would add another by default:
    # tokenized with special tokens, the policy would see two.
    [prompt_ids], [response_ids] = render(tokenizer, [USER], [ANSWER])
    assert prompt_ids[0] == BOS and prompt_ids[1] != BOS
    text = tokenizer.apply_chat_template(USER, tokenize=False, add_generation_prompt=True)
    assert tokenizer(text).input_ids[:2] == [BOS, BOS]  # what add_special_tokens=True would have given
    assert tokenizer.decode(response_ids) == "Canberra.<end_of_turn>\n"


def test_a_prompt_ending_with_the_assistant_is_continued_as_trl_does(tokenizer):
    # Without the sample template's role check, so two assistant turns may follow each other.
    free = with_template(tokenizer, "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m.role }}\n"
                                    "{{ m.content }}<end_of_turn>\n{% endfor %}"
                                    "{% if add_generation_prompt %}<start_of_turn>assistant\n{% endif %}")
    prompt = USER + [{"role": "assistant", "content": "The capital is"}]
    [prompt_ids], [_response_ids] = render(free, [prompt], [[{"role": "assistant", "content": " Canberra."}]])
    continued = free.apply_chat_template(prompt, tokenize=False, continue_final_message=True)
    assert continued.endswith("The capital is")  # no end of turn, no generation prompt
    assert prompt_ids == free(continued, add_special_tokens=False).input_ids


def test_message_keys_that_arrow_filled_with_none_are_dropped(tokenizer):
    keyed = with_template(tokenizer, "{% for m in messages %}{{ m.role }}{% if 'name' in m %}({{ m.name }}){% endif %}"
                                     ":{{ m.content }}\n{% endfor %}"
                                     "{% if add_generation_prompt %}assistant:{% endif %}")
    prompt = [{"role": "user", "content": "hi", "name": None}]
    completion = [{"role": "assistant", "content": "yo", "name": None}]
    [prompt_ids], [response_ids] = render(keyed, [prompt], [completion])
    assert keyed.decode(prompt_ids + response_ids) == "user:hi\nassistant:yo\n"


def test_no_chat_template(tokenizer):
    assert fails(with_template(tokenizer, None), [USER], [ANSWER]) == (
        0, ("prompt holds chat messages, but the tokenizer has no chat template to render them with; "
            "use a tokenizer that has one, or give prompt_ids and response_ids"))


def test_a_template_that_does_not_keep_the_prompt_as_a_prefix(tokenizer):
    # The generation prompt says `A:`, a rendered assistant turn says `Assistant:`.
    odd = with_template(tokenizer, "{% for m in messages %}{% if m.role == 'user' %}User: {{ m.content }}\n"
                                   "{% else %}Assistant: {{ m.content }}\n{% endif %}{% endfor %}"
                                   "{% if add_generation_prompt %}A:{% endif %}")
    assert fails(odd, [USER, USER], [ANSWER, ANSWER]) == (
        0, ("the chat template does not keep the rendered prompt as a prefix of prompt + completion (its generation "
            "prompt ends with 'Australia?\\nA:' where the rendered turn has 'Australia?\\nAssistant: Canberra.\\n'), "
            "so the response tokens cannot be told apart; give prompt_ids and response_ids instead"))


def test_tokens_that_merge_across_the_boundary(tokenizer):
    bare = with_template(tokenizer, "{% for m in messages %}{{ m.content }}{% endfor %}")
    # The texts split cleanly ("Th" + "e quick"), the tokens do not: BPE merges "The".
    assert tokenizer("The", add_special_tokens=False).input_ids != (
        tokenizer("Th", add_special_tokens=False).input_ids + tokenizer("e", add_special_tokens=False).input_ids)
    good = [{"role": "user", "content": "Hello there!"}]
    row, message = fails(bare, [good, [{"role": "user", "content": "Th"}]],
                         [[{"role": "assistant", "content": " Hi"}], [{"role": "assistant", "content": "e quick"}]])
    assert (row, message) == (1, ("the tokens of the rendered prompt are not a prefix of those of the whole "
                                  "conversation (the tokenizer merges across the boundary); give prompt_ids and "
                                  "response_ids instead"))


def test_template_errors_and_bad_messages_name_the_row(tokenizer):
    system_last = [{"role": "user", "content": "hi"}, {"role": "system", "content": "be brief"}]
    assert fails(tokenizer, [USER, system_last], [ANSWER, ANSWER]) == (
        1, ("the last prompt message has role 'system'; TRL renders prompts that end with a user, tool or "
            "assistant message"))
    # The sample template insists that roles alternate, with Gemma's own words.
    assert fails(tokenizer, [USER + ANSWER + ANSWER + USER], [ANSWER]) == (
        0, "the chat template failed: Conversation roles must alternate user/assistant/user/assistant/...")
    assert fails(tokenizer, [USER, []], [ANSWER, ANSWER]) == (1, "prompt holds no messages")
    assert fails(tokenizer, [USER], [None]) == (0, "completion is null")
    assert fails(tokenizer, [USER], [[{"content": "no role"}]]) == (0, "completion holds a message without a role")


def test_an_unknown_rollout_format_is_refused_in_one_line(tmp_path):
    from klpipe.errors import InputError
    from klpipe.precompute.config import PrecomputeConfig

    with pytest.raises(InputError, match=r"^--rollout-format must be trl, verl or atropos, not 'openrlhf'$"):
        PrecomputeConfig(inputs=[tmp_path / "r.parquet"], output=tmp_path / "o.parquet", model="m",
                         rollout_format="openrlhf")
