"""TRL 1.16's own GRPOTrainer tool loop, run on the chat templates TRL ships, as the truth for conversational tool rows.

Each template gets a tokenizer built offline (the `tokenizers` library, no hub) whose vocabulary holds the template's
control tokens as single tokens over a byte-level base, and a tiny Llama built from a config whose
generation_config lists the stop tokens the template's models list. A stand-in generator replaces
`_generate_single_turn` (the model's sampling) and emits scripted assistant turns: the tokens the template renders for
the scripted message, up to and including its first stop token (or, where the template writes none at the end of the
turn, the next message's opening stop token, as GLM's `<|observation|>`; after a final GLM answer, `<|user|>`). All the
rest is TRL's code: prompt tokenization, response parsing, tool execution, `_get_tool_suffix_ids`, the mask and the
logprob placeholders.
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path

import trl
from datasets import Dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.utils import get_json_schema
from trl import GRPOConfig, GRPOTrainer
from trl.chat_template_utils import (
    add_response_schema,
    deepseek_r1_distill_template,
    parse_response,
    supports_tool_calling,
)

TEMPLATES_DIR = Path(trl.__file__).parent / "chat_templates"
# A template's control tokens: <|...|>, <|x>, <x|>, DeepSeek's <｜...｜>, <tag> and </tag>, GLM's [gMASK].
CONTROL = re.compile(r"<\|[^<>|]{1,30}\|>|<\|[a-z_\"]{1,20}>|<[a-z_\"]{1,20}\|>|<｜[^｜]{1,30}｜>|</?[a-z_]{2,20}>"
                     r"|\[gMASK\]")

# Per family: (bos, the tokenizer's eos, generation_config.eos_token_id as tokens), as the families' models list them.
CHATML = (None, "<|im_end|>", ["<|im_end|>", "<|endoftext|>"])
FAMILIES = {
    "qwen": CHATML, "nemotron": ("<s>", "<|im_end|>", ["<|im_end|>", "</s>"]),
    "lfm2": ("<|startoftext|>", "<|im_end|>", ["<|im_end|>"]),
    "llama3": ("<|begin_of_text|>", "<|eot_id|>", ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"]),
    "gemma4": ("<bos>", "<eos>", ["<eos>", "<turn|>", "<|tool_response>"]),
    "glm4moe": (None, "<|endoftext|>", ["<|endoftext|>", "<|user|>", "<|observation|>"]),
    "gptoss": (None, "<|return|>", ["<|return|>", "<|call|>"]),
    "deepseekv3": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", ["<｜end▁of▁sentence｜>"]),
}
# TRL 1.16 ships no response parser for DeepSeek-V3, so GRPOTrainer(tools=...) refuses it as it stands; a user sets
# the one TRL ships for DeepSeek-R1-Distill, which reads the same tool-call syntax.
PARSERS = {"deepseekv3": deepseek_r1_distill_template}
VISION = ("_vl",)  # processors, not tokenizers: out of klpipe's text path


def family(name: str) -> str:
    return next(f for f in FAMILIES if name.startswith(f))


def weather(city: str) -> str:
    """The weather now.

    Args:
        city: The city.
    """
    return f"18 C and sunny in {city}"


def clock(city: str) -> str:
    """The local time.

    Args:
        city: The city.
    """
    return f"14:05 in {city}"


TOOLS = [weather, clock]
TOOL_SCHEMAS = [get_json_schema(tool) for tool in TOOLS]  # what the trainer renders, what klpipe's --tools holds
PROMPT = [{"role": "system", "content": "You are a travel agent."},
          {"role": "user", "content": "Weather and time in Paris?"}]


def call(*calls, content="", reasoning=None) -> dict:
    message = {"role": "assistant", "content": content,
               "tool_calls": [{"type": "function", "function": {"name": n, "arguments": {"city": c}}}
                              for n, c in calls]}
    if reasoning:
        message["reasoning_content"] = reasoning
    return message


def answer(text: str, reasoning=None) -> dict:
    message = {"role": "assistant", "content": text}
    if reasoning:
        message["reasoning_content"] = reasoning
    return message


# The assistant turns each trajectory's stand-in policy emits, in order; the loop runs the tools in between.
TRAJECTORIES = {
    "one call": [call(("weather", "Paris")), answer("It is 18 C and sunny.")],
    "parallel calls": [call(("weather", "Paris"), ("clock", "Paris")), answer("18 C and sunny, 14:05.")],
    "two rounds": [call(("weather", "Paris")), call(("clock", "Paris"), content="Now the time."),
                   answer("18 C, 14:05.")],
    "reasoning": [call(("weather", "Paris"), reasoning="The weather needs a tool."),
                  answer("It is 18 C.", reasoning="The tool said 18 C.")],
    "content with the call": [call(("weather", "Paris"), content="Let me look."), answer("Sunny, 18 C.")],
}


def templates() -> list[str]:
    """Every template TRL 1.16 ships that its tool loop runs on: tool calling supported and a response parser known."""
    names = []
    for path in sorted(TEMPLATES_DIR.glob("*.jinja")):
        name = path.stem
        if name.endswith("_training") or any(v in name for v in VISION):
            continue
        if not any(name.startswith(f) for f in FAMILIES):
            continue
        tokenizer = build_tokenizer(name)
        if supports_tool_calling(tokenizer):
            names.append(name)
    return names


def training_variant(name: str) -> str | None:
    path = TEMPLATES_DIR / f"{name}_training.jinja"
    return path.read_text(encoding="utf-8") if path.is_file() else None


def build_tokenizer(name: str, template: str | None = None) -> PreTrainedTokenizerFast:
    """A byte-level tokenizer whose vocabulary holds `name`'s control tokens as single tokens, with `template` (default
    TRL's `name.jinja`) as its chat template and TRL's response parser for `name` set on it."""
    source = (TEMPLATES_DIR / f"{name}.jinja").read_text(encoding="utf-8")
    bos, eos, stops = FAMILIES[family(name)]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    controls = set(CONTROL.findall(source)) | set(CONTROL.findall(template or "")) | {bos, eos, *stops} - {None}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eos, pad_token=eos)
    tokenizer.add_special_tokens({"additional_special_tokens": sorted(controls)})
    tokenizer.chat_template = source
    if name in PARSERS:
        tokenizer.response_template = PARSERS[name]
    elif supports_tool_calling(tokenizer):
        add_response_schema(tokenizer)  # matched on TRL's own template text, so before any swap
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer


def stop_ids(tokenizer, name: str) -> list[int]:
    return tokenizer.convert_tokens_to_ids(FAMILIES[family(name)][2])


def build_trainer(tokenizer, name: str, output_dir) -> GRPOTrainer:
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=8192)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = stop_ids(tokenizer, name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRL's and transformers' deprecation notes about their own defaults
        args = GRPOConfig(output_dir=str(output_dir), per_device_train_batch_size=2, num_generations=2,
                          max_completion_length=4096, report_to=[], use_cpu=True, bf16=False, logging_steps=1000)
        return GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                           train_dataset=Dataset.from_list([{"prompt": PROMPT}] * 2), processing_class=tokenizer,
                           tools=TOOLS)


class StandIn:
    """The policy: emits the scripted assistant turns, one per call of `_generate_single_turn`, with logprobs."""

    def __init__(self, trainer: GRPOTrainer, turns: list[dict]):
        self.trainer, self.turns, self.history, self.index = trainer, turns, list(PROMPT), 0
        self.template = trainer.chat_template  # None: the tokenizer's own, as TRL renders
        self.tokenizer = trainer.processing_class

    def render(self, messages, **options) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=TOOL_SCHEMAS, tokenize=False,
                                                  chat_template=self.template, **options)

    def turn_ids(self, message: dict, following: dict | None) -> list[int]:
        header = self.render(self.history, add_generation_prompt=True)
        own = self.render(self.history + [message])
        if not own.startswith(header):  # a template that re-renders earlier turns (GPT-OSS): the turn after the prompt
            first_header = self.render(PROMPT, add_generation_prompt=True)
            first_own = self.render(PROMPT + [message])
            if first_own.startswith(first_header):
                header, own = first_header, first_own
        # A generation prompt the rendered turn does not continue (`<think>\n` where the turn has `<think></think>`):
        # the policy writes what the turn renders after the tokens the two share.
        header_ids, own_ids = (self.tokenizer(text, add_special_tokens=False)["input_ids"] for text in (header, own))
        ids = own_ids[len(os.path.commonprefix([header_ids, own_ids])):]  # noqa: RUF071 - of token lists, not paths
        stops = set(self.trainer.eos_token_ids)
        for i, token in enumerate(ids):
            if token in stops:
                return ids[: i + 1]
        # The template writes no stop token after the turn (GLM): the policy stops on the next message's opener.
        opener = "<|observation|>" if following is not None else "<|user|>"
        return ids + [self.tokenizer.convert_tokens_to_ids(opener)]

    def __call__(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        out, logprobs = [], []
        for context in prompt_ids:
            message = self.turns[self.index]
            following = self.turns[self.index + 1] if self.index + 1 < len(self.turns) else None
            ids = self.turn_ids(message, following)
            self.index += 1
            # The next turn is written after the message as the trainer stores it (GPT-OSS: content is `thinking`).
            self.history.append(parse_response(self.tokenizer, ids, prefix=context, tools=TOOLS))
            for tool_call in message.get("tool_calls") or []:
                function = tool_call["function"]
                result = {t.__name__: t for t in TOOLS}[function["name"]](**function["arguments"])
                self.history.append({"role": "tool", "name": function["name"], "content": result})
            out.append(ids)
            logprobs.append([-0.5 - 0.01 * i for i in range(len(ids))])  # any value but the loop's 0.0
        return out, logprobs


def run_loop(trainer: GRPOTrainer, turns: list[dict]) -> dict:
    """TRL's own `_generate` on one prompt, with the stand-in sampling: prompt_ids, completion_ids, tool_mask,
    completions and logprobs as the trainer stores them for a GRPO step."""
    stand_in = StandIn(trainer, turns)
    trainer._generate_single_turn = stand_in
    # What _generate_and_score_completions sets up per batch before it calls _generate: the tools by name.
    trainer._sync_tool_dicts = [{tool.__name__: tool for tool in TOOLS}]
    trainer._async_tool_dicts = [{}]
    prompt_ids, completion_ids, tool_mask, completions, logprobs, *_ = trainer._generate([list(PROMPT)])
    return {"prompt_ids": prompt_ids[0], "completion_ids": completion_ids[0], "tool_mask": tool_mask[0],
            "completion": completions[0], "logprobs": logprobs[0]}
