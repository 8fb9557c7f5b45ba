"""Regenerate every file under ``sample_data/`` deterministically, offline.

Builds:

* a 512-token byte-level BPE tokenizer trained on the small corpus below, with
  Gemma's special-token id layout (``<pad>``=0, ``<eos>``=1, ``<bos>``=2,
  ``<unk>``=3), a post-processor that prepends ``<bos>`` by default, as
  Gemma's tokenizer does, and a Gemma-style chat template that writes
  ``<bos>`` itself (so tokenizing its output with special tokens added would
  double it). ``<start_of_turn>`` and ``<end_of_turn>`` are plain text here,
  not special tokens: adding tokens would change the vocabulary;
* ``tiny-gemma4/``: a random ``Gemma4ForCausalLM`` that keeps the E2B features
  klpipe has to get right: final-logit softcapping, sliding + full attention
  with a window shorter than the sample prompts, KV-shared layers and
  per-layer inputs. Its LM head is scaled by ``HEAD_SCALE`` because a random
  head gives raw logits far below the cap of 30, where ``tanh`` is nearly the
  identity and a pipeline that forgot the softcap would still pass. The
  ``<eos>`` row is scaled further so sampled responses end at varied lengths;
* ``tiny-llama/``: a random ``LlamaForCausalLM`` sharing the tokenizer, as a
  plain architecture with no softcap;
* ``tiny-gemma4-mm/``: a random ``Gemma4ForConditionalGeneration`` in the hub
  checkpoints' layout: the same text config as tiny-gemma4 but with a tied LM
  head (``tie_word_embeddings=True``, so no ``lm_head.weight`` is stored and
  the text weights live under ``model.language_model.*``), plus small but real
  vision and audio towers holding over a third of the parameters, so that
  loading only the text decoder and head visibly saves memory. A tied head
  cannot be scaled apart from the embedding, so the embedding gets
  ``EMBED_SCALE`` as in tiny-gemma4 and the final norm's weight the remaining
  ``HEAD_SCALE / EMBED_SCALE``: raw logits are then those of a head scaled by
  ``HEAD_SCALE``, with a similar share beyond the cap;
* ``rollouts.parquet``: GRPO-style rollouts sampled from a *policy* that is a
  noise-perturbed copy of tiny-gemma4, so that tiny-gemma4 acts as the
  reference model and the policy-vs-reference KL is clearly non-zero.
  Sampling covers the full vocabulary, so a few responses contain ``<pad>`` or
  ``<bos>`` ids mid-sequence; ids, not text, are authoritative;
* ``conversational.parquet``: TRL's conversational prompt-completion format
  (``prompt`` and ``completion`` as lists of messages), sampled from the same
  policy after the chat template rendered each prompt. TRL stores the
  completion as decoded text, so ``policy_logprobs`` are the policy's
  teacher-forced logprobs of the completion as the template renders it (its
  content plus the end-of-turn markup), which is what klpipe scores.

Run ``python sample_data/generate.py`` from anywhere; outputs land next to
this file. Everything is seeded, so reruns reproduce the same bytes of data.
"""

import os

# Must precede the transformers import: nothing here may touch the Hub.
os.environ["HF_HUB_OFFLINE"] = "1"

import copy
import json
import random
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma4AudioConfig,
    Gemma4Config,
    Gemma4ForCausalLM,
    Gemma4ForConditionalGeneration,
    Gemma4TextConfig,
    Gemma4VisionConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)
from transformers.utils import logging as hf_logging

OUT_DIR = Path(__file__).resolve().parent
GEMMA_DIR = OUT_DIR / "tiny-gemma4"
LLAMA_DIR = OUT_DIR / "tiny-llama"
GEMMA_MM_DIR = OUT_DIR / "tiny-gemma4-mm"
ROLLOUTS_PATH = OUT_DIR / "rollouts.parquet"
CONVERSATIONAL_PATH = OUT_DIR / "conversational.parquet"
POLICY_DIR = OUT_DIR / "tiny-gemma4-policy"  # the policy that sampled rollouts.parquet, for precompute --policy
TOOL_CALLS_PATH = OUT_DIR / "tool_calls.parquet"  # TRL's ids: prompt_ids, completion_ids, tool_mask
TOOL_CHAT_PATH = OUT_DIR / "tool_calls_conversational.parquet"  # TRL's messages, tool calls and tools
TOOL_TEMPLATE_PATH = OUT_DIR / "tool_chat_template.jinja"  # the template the tool rows' trainer used (--chat-template)

VOCAB_SIZE = 512
PAD, EOS, BOS, UNK = 0, 1, 2, 3
SOFTCAP = 30.0
SLIDING_WINDOW = 8
# Large enough that a clear share of raw logits lands beyond the softcap, and no larger:
# every extra factor amplifies fp32 rounding noise, which the 1e-4 oracle tests must stay under.
HEAD_SCALE = 100.0
# Relative (per-tensor RMS) Gaussian noise that turns the reference into the
# policy; tuned so the mean per-token KL estimate is a few nats, i.e. visible
# in the adaptive KL controller without being absurd.
POLICY_NOISE = 0.2
# A random head almost never picks <eos>, which would make every response
# exactly MAX_NEW_TOKENS long. Giving the <eos> row a larger norm pushes its
# raw logit past the cap at a good share of positions, so responses end at
# natural, varied lengths.
EOS_ROW_SCALE = 4.0
# A random 6-layer Gemma is chaotic: fp32 rounding differences between a padded batch and a
# single sequence grow ~2x per layer, and the x100 head turns them into ~1e-4 logprob noise,
# the oracle tests' whole tolerance. A larger token embedding keeps the residual stream
# dominated by it, so the noise drops ~10x while attention still moves logprobs by nats
# (a sliding-window or padding bug still shows up 10^4 times above the tolerance).
EMBED_SCALE = 30.0
MAX_NEW_TOKENS = 24
STEPS = 6
SAMPLES_PER_GROUP = 4

SEED_TOKENIZER_SHUFFLE = 0
SEED_GEMMA = 1234
SEED_LLAMA = 4321
SEED_GEMMA_MM = 1235
SEED_POLICY_NOISE = 777
SEED_SAMPLING = 2024
SEED_REWARD = 99
# Separate streams, so the conversational file leaves every byte of the others as it was.
# Picked so that no token's |policy − ref| passes the 20 nats at which `klpipe score` warns of a
# tokenization mismatch: with random models a few seeds get there by chance.
SEED_CHAT_SAMPLING = 2028
SEED_CHAT_REWARD = 100
SEED_TOOL_SAMPLING = 2031
SEED_TOOL_REWARD = 101

# Gemma's layout: `<start_of_turn>ROLE\n...<end_of_turn>\n`, the assistant called `model`, a system
# message folded into the first user turn, roles that must alternate, and `<bos>` written by the
# template itself. Tool use as Qwen's templates render it, in that layout: the tool schemas as JSON
# lines in the first turn, an assistant's calls as `<tool_call>{...}</tool_call>` after its content,
# a tool's result as a `tool` turn that answers a call.
CHAT_TEMPLATE = """\
{{- bos_token -}}
{%- if messages and messages[0]['role'] == 'system' -%}
    {%- set system_prefix = (messages[0]['content'] | trim) + '\\n\\n' -%}
    {%- set turns = messages[1:] -%}
{%- else -%}
    {%- set system_prefix = '' -%}
    {%- set turns = messages -%}
{%- endif -%}
{%- if tools -%}
    {%- set listed = namespace(text='Tools:\\n') -%}
    {%- for tool in tools -%}
        {%- set listed.text = listed.text + (tool | tojson(separators=(',', ':'))) + '\\n' -%}
    {%- endfor -%}
    {%- set system_prefix = system_prefix + listed.text + '\\n' -%}
{%- endif -%}
{%- set state = namespace(previous='') -%}
{%- for message in turns -%}
    {%- set role = message['role'] -%}
    {%- if role == 'tool' -%}
        {%- if state.previous not in ['assistant', 'tool'] -%}
            {{- raise_exception('A tool message must answer an assistant tool call') -}}
        {%- endif -%}
    {%- elif (role == 'user' and state.previous not in ['', 'assistant']) or (role == 'assistant' and state.previous not in ['user', 'tool']) or role not in ['user', 'assistant'] -%}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') -}}
    {%- endif -%}
    {%- set state.previous = role -%}
    {{- '<start_of_turn>' + ('model' if role == 'assistant' else role) + '\\n' + (system_prefix if loop.first else '') -}}
    {{- (message['content'] or '') | trim -}}
    {%- for call in message.get('tool_calls') or [] -%}
        {%- set function = call['function'] if call['function'] is defined else call -%}
        {%- set arguments = function['arguments'] if function['arguments'] is string else (function['arguments'] | tojson) -%}
        {{- '<tool_call>{\\"name\\": ' + (function['name'] | tojson) + ', \\"arguments\\": ' + arguments + '}</tool_call>' -}}
    {%- endfor -%}
    {{- '<end_of_turn>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<start_of_turn>model\\n' -}}
{%- endif -%}
"""  # noqa: E501 - the tokenizer's template as written: a statement a line, as the hub's are

# The tool rows' trainer rendered with this variant, whose turns end with the tokenizer's EOS: a policy stops on a
# single stop token, and the tiny tokenizer holds `<end_of_turn>` as several. klpipe reads it with --chat-template.
TOOL_CHAT_TEMPLATE = CHAT_TEMPLATE.replace("{{- '<end_of_turn>\\n' -}}", "{{- eos_token + '\\n' -}}")
assert TOOL_CHAT_TEMPLATE != CHAT_TEMPLATE

# Conversational groups: (step, prompt messages). One with a system message, one multi-turn.
CONVERSATIONS = [
    (0, [{"role": "user", "content": "What is the capital of Australia, and why is it not Sydney?"}]),
    (0, [{"role": "system", "content": "Answer in one short sentence."},
         {"role": "user", "content": "Explain why the sky looks blue during the day and red at sunset."}]),
    (1, [{"role": "user", "content": "Write a haiku about autumn leaves drifting across a cold pond."},
         {"role": "assistant", "content": "Leaves drift on the pond."},
         {"role": "user", "content": "Translate the sentence into French: the cat is sleeping on the chair."}]),
    (1, [{"role": "user", "content": "Hello there!"}]),
]

# Tool-calling trajectories, one row each, as TRL's GRPOTrainer(tools=...) stores them: a system
# prompt (character, rules) opens every row, the completion holds the model's call, the tool's
# result and the model's answer. TOOL_GROUP responses per task.
TOOL_SYSTEM = "You are Ada, a travel agent. Use a tool for facts that change; never invent one."
TOOLS = [
    {"type": "function", "function": {
        "name": "weather", "description": "Weather now.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "train", "description": "Next train.",
        "parameters": {"type": "object", "properties": {"from": {"type": "string"}, "to": {"type": "string"}}}}},
]
# (user message, the call the model makes, the tool's result)
TOOL_TASKS = [
    ("Is it raining in Berlin?", ("weather", {"city": "Berlin"}), "12 C, rain"),
    ("When is the next train from Paris to Lyon?", ("train", {"from": "Paris", "to": "Lyon"}), "10:30, platform 7"),
    ("Should I pack a coat for Oslo today?", ("weather", {"city": "Oslo"}), "-3 C, snow"),
    ("Can I get from Rome to Milan before noon?", ("train", {"from": "Rome", "to": "Milan"}), "08:05"),
]
TOOL_GROUP = 8
# A policy closer to the reference than POLICY_NOISE's: the fixed tool-call text both models read
# teacher-forced is unlikely under each, and POLICY_NOISE spreads their logprobs of it past the
# 20 nats at which `klpipe score` warns of a tokenization mismatch.
TOOL_POLICY_NOISE = 0.05
TOOL_FIRST_TOKENS = 6  # sampled before the call
TOOL_ANSWER_TOKENS = 12  # sampled after the result

CORPUS = [
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "A gentle rain fell on the quiet village while the children slept.",
    "Please summarize the following paragraph in one short sentence.",
    "Reinforcement learning trains a policy to maximize expected reward.",
    "The reference model stays frozen while the policy keeps changing.",
    "Kullback-Leibler divergence measures how one distribution differs from another.",
    "She opened the old wooden door and found a garden full of roses.",
    "Two plus three equals five, and five times four equals twenty.",
    "Write a haiku about autumn leaves drifting across a cold pond.",
    "The library closes at nine o'clock on weekdays and at noon on Sundays.",
    "Our team shipped the new release after fixing three critical bugs.",
    "Mountains rise above the clouds where eagles circle in the wind.",
    "Translate the sentence into French: the cat is sleeping on the chair.",
    "He poured a cup of strong coffee and read the morning newspaper.",
    "Every prime number greater than two is odd, but not every odd number is prime.",
    "The museum displays paintings, sculptures, and ancient pottery from Greece.",
    "Explain why the sky looks blue during the day and red at sunset.",
    "A small robot rolled across the kitchen floor looking for crumbs.",
    "The train to Berlin leaves from platform seven at half past ten.",
    "Water boils at one hundred degrees Celsius at sea level.",
    "Good software is tested, documented, and easy to change later.",
    "The orchestra tuned their instruments before the concert began.",
    "What is the capital of Australia, and why is it not Sydney?",
    "Bright stars shimmered over the desert as the campfire crackled.",
    "Sort the list of numbers from smallest to largest and print it.",
    "The farmer planted wheat in spring and harvested it in late summer.",
    "Gradient descent takes small steps in the direction of steepest decrease.",
    "My grandmother bakes bread every Saturday morning before sunrise.",
    "The detective noticed a muddy footprint beside the broken window.",
    "Thank you for your help; I could not have finished without you.",
    "Ocean waves crashed against the rocks, sending spray into the air.",
    "A tokenizer splits text into pieces that a language model can read.",
    "The committee will vote on the proposal next Tuesday afternoon.",
    "Lions rest in the shade during the hottest hours of the day.",
    "Compute the average of seven, eleven, and fifteen, then round it.",
    "The violinist played a slow melody that filled the empty hall.",
    "Fresh snow covered the streets, and the city became strangely silent.",
    "Always back up your files before upgrading the operating system.",
    "The spaceship drifted past Jupiter, its engines humming softly.",
    "Which weighs more, a kilogram of feathers or a kilogram of iron?",
    "Children laughed as they chased bubbles through the sunny park.",
    "The chef added a pinch of salt, some pepper, and fresh basil.",
    "History shows that bridges, roads, and ports help cities grow.",
    "Is it better to sample with temperature one or to decode greedily?",
    "The old lighthouse keeper climbed the stairs every single night.",
    "Bees carry pollen from flower to flower throughout the warm season.",
    "Numbers like 3.14, 42, and 2048 often appear in examples and jokes.",
    "If the policy drifts too far, the controller raises the KL penalty.",
    "Yes.",
    "No, thank you.",
    "Hello there!",
    "Once upon a time,",
]

# Two prompts per step. A mix of short ones (fewer tokens than the sliding
# window) and long ones (well past it) so both attention paths matter.
PROMPTS = [
    "Hello there!",
    "Explain why the sky looks blue during the day and red at sunset.",
    "Once upon a time,",
    "Which weighs more, a kilogram of feathers or a kilogram of iron?",
    "Yes.",
    "If the policy drifts too far, the controller raises the KL penalty.",
    "Write a haiku about autumn leaves drifting across a cold pond.",
    "No, thank you.",
    "Translate the sentence into French: the cat is sleeping on the chair.",
    "Sort the list of numbers from smallest to largest and print it.",
    "The quick brown fox",
    "Compute the average of seven, eleven, and fifteen, then round it.",
]
assert len(PROMPTS) == 2 * STEPS


def build_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    # Byte-level so any text, including sampled garbage, round-trips.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        # Listed first so they get ids 0..3 in Gemma's order.
        special_tokens=["<pad>", "<eos>", "<bos>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = list(CORPUS)
    random.Random(SEED_TOKENIZER_SHUFFLE).shuffle(corpus)
    tok.train_from_iterator(corpus, trainer=trainer)
    # The model's embedding has VOCAB_SIZE rows; a smaller tokenizer would let
    # the policy sample ids the tokenizer cannot decode.
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    for name, idx in [("<pad>", PAD), ("<eos>", EOS), ("<bos>", BOS), ("<unk>", UNK)]:
        assert tok.token_to_id(name) == idx, (name, tok.token_to_id(name))
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A",
        pair="<bos> $A $B:1",
        special_tokens=[("<bos>", BOS)],
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=512,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def check_tokenizer(model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(model_dir)
    text = "Héllo,  wörld! 🙂\n\ttabs"
    with_bos = tok(text).input_ids
    without = tok(text, add_special_tokens=False).input_ids
    assert with_bos[0] == BOS and with_bos[1:] == without, (with_bos, without)
    assert BOS not in without
    assert tok.decode(without) == text
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id, tok.unk_token_id) == (PAD, EOS, BOS, UNK)
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": " Hello! "}]
    rendered = tok.apply_chat_template(chat, tokenize=False)
    expected = "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
    assert rendered == expected, rendered
    ids = tok.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"]
    assert ids[0] == BOS and ids[1] != BOS, ids  # the template's own <bos>, once


def gemma_config(tie_word_embeddings: bool = False) -> Gemma4TextConfig:
    # Non-shared layers (0..3) must hold both attention types, since each
    # KV-shared layer reuses the cache of the last earlier layer of its type.
    layer_types = [
        "sliding_attention",
        "sliding_attention",
        "full_attention",
        "sliding_attention",
        "sliding_attention",
        "full_attention",
    ]
    return Gemma4TextConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        global_head_dim=32,
        sliding_window=SLIDING_WINDOW,
        num_kv_shared_layers=2,
        final_logit_softcapping=SOFTCAP,
        hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=VOCAB_SIZE,
        tie_word_embeddings=tie_word_embeddings,
        max_position_embeddings=512,
        layer_types=layer_types,
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=BOS,
    )


def gemma_mm_config() -> Gemma4Config:
    """tiny-gemma4's text config with a tied head, and towers sized so model.safetensors stays under 2 MB."""
    vision = Gemma4VisionConfig(
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=24,
        patch_size=4,
        position_embedding_size=64,
        pooling_kernel_size=2,
    )
    audio = Gemma4AudioConfig(
        hidden_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        # The subsampling projection assumes as many mel bins as channels[0] (128 in the real model).
        subsampling_conv_channels=[16, 8],
        output_proj_dims=64,
    )
    # The image/audio placeholder ids stay at their defaults, beyond the 512-token vocabulary: no text
    # token is ever taken for one, so the full model's text-only forward is the text decoder's.
    return Gemma4Config(
        text_config=gemma_config(tie_word_embeddings=True).to_dict(),
        vision_config=vision.to_dict(),
        audio_config=audio.to_dict(),
        tie_word_embeddings=True,
    )


def llama_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=BOS,
    )


def save_and_verify(model, tokenizer, out_dir: Path, probe_ids: torch.Tensor):
    """Save `model` with safetensors and the tokenizer, reload it, and return the reloaded model once it
    loads cleanly as the same class with bit-equal logits."""
    if out_dir.exists():
        # Stale files (e.g. an old pytorch_model.bin) would otherwise survive.
        shutil.rmtree(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    assert not list(out_dir.glob("*.bin")), "expected safetensors only"
    check_tokenizer(out_dir)

    reloaded, info = AutoModelForCausalLM.from_pretrained(out_dir, output_loading_info=True)
    reloaded.eval()
    problems = {k: v for k, v in info.items() if v}
    assert not problems, f"{out_dir.name}: loading info not clean: {problems}"
    assert type(reloaded) is type(model), type(reloaded)
    with torch.no_grad():
        before = model(probe_ids).logits
        after = reloaded(probe_ids).logits
    assert torch.equal(before, after), (before - after).abs().max()
    return reloaded


def build_gemma() -> Gemma4ForCausalLM:
    torch.manual_seed(SEED_GEMMA)
    model = Gemma4ForCausalLM(gemma_config()).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(HEAD_SCALE)
        model.lm_head.weight[EOS].mul_(EOS_ROW_SCALE)
        model.model.embed_tokens.weight.mul_(EMBED_SCALE)
    return model


def build_gemma_mm() -> Gemma4ForConditionalGeneration:
    torch.manual_seed(SEED_GEMMA_MM)
    model = Gemma4ForConditionalGeneration(gemma_mm_config()).eval()
    text = model.model.language_model
    assert model.lm_head.weight is text.embed_tokens.weight, "expected a tied head"
    with torch.no_grad():
        text.embed_tokens.weight.mul_(EMBED_SCALE)
        # Logits are (final norm) @ W.T: scaling the norm scales the head without touching the embedding.
        text.norm.weight.mul_(HEAD_SCALE / EMBED_SCALE)
    return model


@torch.no_grad()
def check_gemma_mm(out_dir: Path, model, probe_ids: torch.Tensor) -> None:
    """The multimodal checkpoint is what the hub ships: tied head, text under model.language_model, towers that run.

    `model` is the checkpoint as save_and_verify reloaded it."""
    from safetensors import safe_open

    with safe_open(out_dir / "model.safetensors", framework="pt") as fh:
        keys = set(fh.keys())
    assert "lm_head.weight" not in keys, "a tied head must not be stored"
    assert "model.language_model.embed_tokens.weight" in keys
    towers = [k for k in keys if not k.startswith("model.language_model.")]
    assert any(k.startswith("model.vision_tower.") for k in towers)
    assert any(k.startswith("model.audio_tower.") for k in towers)

    assert model.lm_head.weight is model.model.language_model.embed_tokens.weight, "head not tied after reload"
    # The full model's text-only forward is its text decoder's plus the tied, softcapped head.
    hidden = model.model.language_model(input_ids=probe_ids).last_hidden_state
    expected = SOFTCAP * torch.tanh(hidden @ model.lm_head.weight.T / SOFTCAP)
    torch.testing.assert_close(model(input_ids=probe_ids).logits, expected, rtol=0, atol=1e-4)

    # Real towers: a 16x16 image (4x4 patches of 4x4 pixels, pooled 2x2 into 4 soft tokens), and 32 frames of
    # 16 mel bins (two stride-2 convolutions: 8 soft tokens).
    gen = torch.Generator().manual_seed(0)
    vision = model.config.vision_config
    side = 16 // vision.patch_size
    pixels = torch.rand(1, side * side, 3 * vision.patch_size**2, generator=gen)
    grid = torch.stack(torch.meshgrid(torch.arange(side), torch.arange(side), indexing="xy"), dim=-1).reshape(1, -1, 2)
    image = model.model.get_image_features(pixels, grid).pooler_output
    assert tuple(torch.cat(image).shape) == (side * side // vision.pooling_kernel_size**2, 64), [t.shape for t in image]
    mel = model.config.audio_config.subsampling_conv_channels[0]
    audio = model.model.get_audio_features(torch.randn(1, 32, mel, generator=gen), torch.ones(1, 32, dtype=torch.bool))
    assert tuple(audio.pooler_output.shape) == (1, 8, 64), audio.pooler_output.shape
    assert torch.isfinite(torch.cat(image)).all() and torch.isfinite(audio.pooler_output).all()


def build_llama() -> LlamaForCausalLM:
    torch.manual_seed(SEED_LLAMA)
    return LlamaForCausalLM(llama_config()).eval()


def head_logits_over_cap(model: Gemma4ForCausalLM | Gemma4ForConditionalGeneration, ids: torch.Tensor) -> float:
    """Fraction of raw (pre-softcap) head logits with |z| > SOFTCAP."""
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state
        raw = hidden @ model.lm_head.weight.T
        capped = model(input_ids=ids).logits
    assert raw.abs().max() > SOFTCAP, raw.abs().max()
    # Guards against a transformers change silently dropping the softcap.
    torch.testing.assert_close(capped, SOFTCAP * torch.tanh(raw / SOFTCAP), rtol=1e-5, atol=1e-4)
    return (raw.abs() > SOFTCAP).float().mean().item()


def make_policy(ref: Gemma4ForCausalLM, noise: float = POLICY_NOISE) -> Gemma4ForCausalLM:
    policy = copy.deepcopy(ref)
    gen = torch.Generator().manual_seed(SEED_POLICY_NOISE)
    with torch.no_grad():
        for _, param in sorted(policy.named_parameters()):
            # Scale by each tensor's own RMS: the x100 head and the O(1) norms
            # get the same relative perturbation.
            rms = param.pow(2).mean().sqrt()
            param.add_(torch.randn(param.shape, generator=gen) * rms * noise)
    return policy


@torch.no_grad()
def sample_group(policy, prompt_ids: list[int], n: int, gen: torch.Generator, max_new_tokens: int = MAX_NEW_TOKENS):
    """Sample n responses with full forward passes (no KV cache)."""
    seqs = torch.tensor([prompt_ids] * n)
    responses = [[] for _ in range(n)]
    logprobs = [[] for _ in range(n)]
    done = [False] * n
    for _ in range(max_new_tokens):
        logits = policy(input_ids=seqs, use_cache=False).logits[:, -1, :].float()
        logp = torch.log_softmax(logits, dim=-1)
        nxt = torch.multinomial(logp.exp(), 1, generator=gen)
        for i in range(n):
            if done[i]:
                continue
            t = int(nxt[i, 0])
            responses[i].append(t)
            logprobs[i].append(float(logp[i, t]))
            done[i] = t == EOS
        if all(done):
            break
        seqs = torch.cat([seqs, nxt], dim=1)
    return responses, logprobs


@torch.no_grad()
def teacher_forced_logprobs(model, prompt_ids: list[int], response_ids: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt_ids + response_ids])
    logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
    pos = torch.arange(len(prompt_ids) - 1, ids.shape[1] - 1)
    return logp[pos, torch.tensor(response_ids)]


def reward_fn(response_ids: list[int], tokenizer, rng: random.Random) -> float:
    # "Readability": share of ASCII letters/spaces in the text. Distinct-token
    # fraction would be ~1.0 for nearly every random sample, leaving GRPO
    # groups with no reward signal beyond the noise.
    text = tokenizer.decode(response_ids, skip_special_tokens=True)
    readable = sum(c.isascii() and (c.isalpha() or c == " ") for c in text) / len(text) if text else 0.0
    return readable + rng.gauss(0.0, 0.05)


def build_rollouts(tokenizer, ref, policy):
    gen = torch.Generator().manual_seed(SEED_SAMPLING)
    reward_rng = random.Random(SEED_REWARD)
    rows = []
    kl_terms = []
    for step in range(STEPS):
        for p in range(2):
            prompt = PROMPTS[2 * step + p]
            prompt_ids = tokenizer(prompt).input_ids
            responses, logprobs = sample_group(policy, prompt_ids, SAMPLES_PER_GROUP, gen)
            group_id = 2 * step + p
            for g, (resp, lps) in enumerate(zip(responses, logprobs, strict=True)):
                pol_tf = teacher_forced_logprobs(policy, prompt_ids, resp)
                # Incremental sampling and one full forward must agree, or the
                # stored logprobs would not be what stage 2 assumes they are.
                torch.testing.assert_close(pol_tf, torch.tensor(lps), rtol=0, atol=1e-3)
                ref_tf = teacher_forced_logprobs(ref, prompt_ids, resp)
                kl_terms.append(pol_tf - ref_tf)
                rows.append(
                    {
                        "id": f"s{step}-p{p}-g{g}",
                        "step": step,
                        "group_id": group_id,
                        "prompt": prompt,
                        # Special tokens kept so an emitted <eos> survives in text mode.
                        "response": tokenizer.decode(resp, skip_special_tokens=False),
                        "prompt_ids": prompt_ids,
                        "response_ids": resp,
                        "policy_logprobs": lps,
                        "reward": reward_fn(resp, tokenizer, reward_rng),
                    }
                )
    return rows, torch.cat(kl_terms)


@torch.no_grad()
def build_conversational(tokenizer, ref, policy):
    """TRL prompt-completion rows: render, sample, store the completion as text, as TRL does."""
    gen = torch.Generator().manual_seed(SEED_CHAT_SAMPLING)
    reward_rng = random.Random(SEED_CHAT_REWARD)
    rows = []
    worst = 0.0  # largest per-token |policy − ref|
    for group_id, (step, prompt) in enumerate(CONVERSATIONS):
        prompt_ids = tokenizer.apply_chat_template(
            prompt, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        responses, _ = sample_group(policy, prompt_ids, SAMPLES_PER_GROUP, gen)
        for g, sampled in enumerate(responses):
            completion = [{"role": "assistant", "content": tokenizer.decode(sampled, skip_special_tokens=True)}]
            whole_ids = tokenizer.apply_chat_template(prompt + completion, tokenize=True, return_dict=True)["input_ids"]
            assert whole_ids[: len(prompt_ids)] == prompt_ids, "the template must keep the prompt as a prefix"
            response_ids = whole_ids[len(prompt_ids):]
            policy_logprobs = teacher_forced_logprobs(policy, prompt_ids, response_ids)
            ref_logprobs = teacher_forced_logprobs(ref, prompt_ids, response_ids)
            worst = max(worst, (policy_logprobs - ref_logprobs).abs().max().item())
            rows.append(
                {
                    "id": f"c{group_id}-g{g}",
                    "step": step,
                    "group_id": group_id,
                    "prompt": prompt,
                    "completion": completion,
                    "policy_logprobs": policy_logprobs.tolist(),
                    "reward": reward_fn(sampled, tokenizer, reward_rng),
                }
            )
    return rows, worst


def trl_tool_row(tokenizer, prompt: list[dict], completion: list[dict], tools: list):
    """(prompt_ids, completion_ids, tool_mask) as TRL 1.16's GRPOTrainer tool loop builds them, by klpipe's renderer
    (tests/precompute/test_trl_tool_loop.py holds it to TRL's own loop): each sampled turn up to and including its EOS,
    mask 1; the tool block TRL appends, mask 0."""
    from klpipe.precompute.chat import ChatRenderer

    renderer = ChatRenderer(tokenizer, "prompt", "completion", tools=tools, template_given=True)
    [prompt_ids], [completion_ids], [mask] = renderer.render([prompt], [completion])
    return prompt_ids, completion_ids, mask.astype(int).tolist()


@torch.no_grad()
def build_tool_calls(tokenizer, ref, policy):
    """Tool-calling rows: the model's turn, a call, the tool's result, the model's answer, in one completion."""
    gen = torch.Generator().manual_seed(SEED_TOOL_SAMPLING)
    reward_rng = random.Random(SEED_TOOL_REWARD)
    rows = []
    worst = 0.0  # largest |policy − ref| on a token the policy sampled
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    for group_id, (question, (name, arguments), result) in enumerate(TOOL_TASKS):
        prompt = [{"role": "system", "content": TOOL_SYSTEM}, {"role": "user", "content": question}]
        # Each row's tools column holds the tool its task offers (the tiny models' context is 512 tokens).
        tools = [tool for tool in TOOLS if tool["function"]["name"] == name]
        prompt_ids = tokenizer.apply_chat_template(prompt, tools=tools, add_generation_prompt=True, tokenize=True,
                                                   return_dict=True)["input_ids"]
        firsts, _ = sample_group(policy, prompt_ids, TOOL_GROUP, gen, TOOL_FIRST_TOKENS)
        for g, first in enumerate(firsts):
            function = {"name": name, "arguments": json.dumps(arguments)}
            call = {"role": "assistant", "content": tokenizer.decode(first, skip_special_tokens=True),
                    "tool_calls": [{"type": "function", "function": function}]}
            answered = [call, {"role": "tool", "name": name, "content": result}]
            # The answer is sampled where TRL's loop samples it: after the call's EOS and the tool block.
            _, history, _ = trl_tool_row(tokenizer, prompt, answered + [{"role": "assistant", "content": ""}], tools)
            history = prompt_ids + history[: -1]  # less the empty answer's EOS
            [answer], _ = sample_group(policy, history, 1, gen, TOOL_ANSWER_TOKENS)
            said = tokenizer.decode(answer, skip_special_tokens=True)
            completion = answered + [{"role": "assistant", "content": said}]
            prompt_ids_again, completion_ids, mask = trl_tool_row(tokenizer, prompt, completion, tools)
            assert prompt_ids_again == prompt_ids
            assert len(prompt_ids) + len(completion_ids) <= 448  # the tiny models' context is 512
            policy_lp = teacher_forced_logprobs(policy, prompt_ids, completion_ids)
            ref_lp = teacher_forced_logprobs(ref, prompt_ids, completion_ids)
            worst = max([worst] + [abs(p - r) for p, r, m in zip(policy_lp.tolist(), ref_lp.tolist(), mask, strict=True)
                                   if m])
            rows.append({
                "id": f"tool{group_id}-g{g}", "step": group_id // 2, "group_id": group_id,
                "prompt": prompt, "completion": completion, "tools": json.dumps(tools),
                "prompt_ids": prompt_ids, "completion_ids": completion_ids, "tool_mask": mask,
                # TRL's sampler logprob of a tool's token is a placeholder 0.0
                "policy_logprobs": [lp if m else 0.0 for lp, m in zip(policy_lp.tolist(), mask, strict=True)],
                "reward": reward_fn(first + answer, tokenizer, reward_rng),
            })
    for row in rows:
        row["sampled_logprobs"] = row["policy_logprobs"]
    # TRL masks a truncated completion whole (mask_truncated_completions): the last row stands for one.
    rows[-1]["tool_mask"] = [0] * len(rows[-1]["tool_mask"])
    rows[-1]["policy_logprobs"] = [0.0] * len(rows[-1]["policy_logprobs"])
    return rows, worst


def write_tool_calls(rows) -> None:
    """The same trajectories twice: as TRL's ids with a tool_mask, and as TRL's messages with the tools."""
    ids = pa.schema([("id", pa.string()), ("step", pa.int64()), ("group_id", pa.int64()),
                     ("prompt_ids", pa.list_(pa.int32())), ("completion_ids", pa.list_(pa.int32())),
                     ("tool_mask", pa.list_(pa.int8())), ("policy_logprobs", pa.list_(pa.float32())),
                     ("reward", pa.float64())])
    pq.write_table(pa.Table.from_pylist([{k: r[k] for k in ids.names} for r in rows], schema=ids), TOOL_CALLS_PATH)
    function = pa.struct([("name", pa.string()), ("arguments", pa.string())])
    call = pa.struct([("type", pa.string()), ("function", function)])
    message = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string()), ("name", pa.string()),
                                  ("tool_calls", pa.list_(call))]))
    chat = pa.schema([("id", pa.string()), ("step", pa.int64()), ("group_id", pa.int64()), ("prompt", message),
                      ("completion", message), ("tools", pa.string()), ("policy_logprobs", pa.list_(pa.float32())),
                      ("reward", pa.float64())])
    # In message form the roles give the mask, so no row is masked whole.
    table = pa.Table.from_pylist([{**{k: r[k] for k in chat.names}, "policy_logprobs": r["sampled_logprobs"]}
                                  for r in rows], schema=chat)
    pq.write_table(table, TOOL_CHAT_PATH)


def write_conversational(rows) -> None:
    messages = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    schema = pa.schema(
        [
            ("id", pa.string()),
            ("step", pa.int64()),
            ("group_id", pa.int64()),
            ("prompt", messages),
            ("completion", messages),
            ("policy_logprobs", pa.list_(pa.float32())),
            ("reward", pa.float64()),
        ]
    )
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), CONVERSATIONAL_PATH)


def write_parquet(rows) -> None:
    schema = pa.schema(
        [
            ("id", pa.string()),
            ("step", pa.int64()),
            ("group_id", pa.int64()),
            ("prompt", pa.string()),
            ("response", pa.string()),
            ("prompt_ids", pa.list_(pa.int32())),
            ("response_ids", pa.list_(pa.int32())),
            ("policy_logprobs", pa.list_(pa.float32())),
            ("reward", pa.float64()),
        ]
    )
    table = pa.Table.from_pylist(rows, schema=schema)
    pq.write_table(table, ROLLOUTS_PATH)


def main() -> None:
    hf_logging.disable_progress_bar()
    # CPU float reductions can vary with the thread count, and one flipped
    # low bit can change a sampled token; a single thread keeps reruns stable.
    torch.set_num_threads(1)

    tokenizer = build_tokenizer()
    long_prompt = "Kullback-Leibler divergence measures how one distribution differs from another."
    probe = torch.tensor([tokenizer(long_prompt).input_ids])
    assert probe.shape[1] > SLIDING_WINDOW

    gemma = build_gemma()
    over_cap = head_logits_over_cap(gemma, probe)
    save_and_verify(gemma, tokenizer, GEMMA_DIR, probe)
    save_and_verify(build_llama(), tokenizer, LLAMA_DIR, probe)

    prompt_lens = [len(tokenizer(p).input_ids) for p in PROMPTS]
    assert max(prompt_lens) >= 12 and min(prompt_lens) < SLIDING_WINDOW, prompt_lens

    policy = make_policy(gemma).eval()
    rows, kl_terms = build_rollouts(tokenizer, gemma, policy)
    write_parquet(rows)
    conversational, worst_diff = build_conversational(tokenizer, gemma, policy)
    write_conversational(conversational)
    tool_rows, tool_worst = build_tool_calls(tokenizer, gemma, make_policy(gemma, TOOL_POLICY_NOISE).eval())
    write_tool_calls(tool_rows)
    TOOL_TEMPLATE_PATH.write_text(TOOL_CHAT_TEMPLATE, encoding="utf-8")

    save_and_verify(policy, tokenizer, POLICY_DIR, probe)

    # Last, and from its own seed: nothing above depends on it.
    gemma_mm = build_gemma_mm()
    mm_over_cap = head_logits_over_cap(gemma_mm, probe)
    check_gemma_mm(GEMMA_MM_DIR, save_and_verify(gemma_mm, tokenizer, GEMMA_MM_DIR, probe), probe)
    text_params = sum(p.numel() for p in gemma_mm.model.language_model.parameters())
    all_params = sum(p.numel() for p in gemma_mm.parameters())

    lengths = [len(r["response_ids"]) for r in rows]
    n_eos = sum(r["response_ids"][-1] == EOS for r in rows)
    round_trip = sum(
        tokenizer(r["response"], add_special_tokens=False).input_ids == r["response_ids"] for r in rows
    )
    mean_kl = kl_terms.mean().item()

    print(f"head logits with |z| > {SOFTCAP:g}: {over_cap:.1%}")
    print(f"tiny-gemma4-mm: head logits with |z| > {SOFTCAP:g}: {mm_over_cap:.1%}; "
          f"towers hold {1 - text_params / all_params:.0%} of {all_params} parameters")
    print(f"prompt lengths (tokens incl. <bos>): {prompt_lens}")
    print(f"response lengths: {lengths}")
    print(f"responses ending in <eos>: {n_eos}/{len(rows)}")
    print(f"mean per-token KL estimate mean(policy_lp - ref_lp): {mean_kl:.3f} nats over {kl_terms.numel()} tokens")
    print(f"responses that round-trip text -> ids: {round_trip}/{len(rows)}")
    tool_tokens = sum(len(r["tool_mask"]) for r in tool_rows)
    print(f"tool-calling rows: {len(tool_rows)}, {tool_tokens} completion tokens, "
          f"{sum(sum(r['tool_mask']) for r in tool_rows)} of them the policy's, largest |policy - ref| there "
          f"{tool_worst:.1f} nats")
    print(f"conversational rows: {len(conversational)}, rendered response lengths: "
          f"{[len(r['policy_logprobs']) for r in conversational]}, largest |policy - ref| {worst_diff:.1f} nats")
    # Checked after printing so a failed retune still shows the numbers.
    assert 1 in lengths, "want at least one length-1 response"
    assert len(set(lengths)) > 3, lengths
    assert 0.5 <= mean_kl <= 6.0, mean_kl
    assert worst_diff < 20.0, worst_diff
    assert tool_worst < 20.0, tool_worst
    for path in sorted(OUT_DIR.rglob("*")):
        if path.is_file() and path.name != Path(__file__).name:
            size = path.stat().st_size
            assert size <= 2 * 1024 * 1024, (path, size)
            print(f"{size:>9}  {path.relative_to(OUT_DIR)}")


def tool_rows_only() -> None:
    """`generate.py --tool-rows`: the tool rows and their template alone, from the saved tiny Gemma."""
    hf_logging.disable_progress_bar()
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(GEMMA_DIR)
    gemma = Gemma4ForCausalLM.from_pretrained(GEMMA_DIR, dtype=torch.float32).eval()
    tool_rows, tool_worst = build_tool_calls(tokenizer, gemma, make_policy(gemma, TOOL_POLICY_NOISE).eval())
    write_tool_calls(tool_rows)
    TOOL_TEMPLATE_PATH.write_text(TOOL_CHAT_TEMPLATE, encoding="utf-8")
    print(f"tool-calling rows: {len(tool_rows)}, largest |policy - ref| on the policy's tokens {tool_worst:.1f} nats")
    assert tool_worst < 20.0, tool_worst


if __name__ == "__main__":
    import sys

    tool_rows_only() if sys.argv[1:] == ["--tool-rows"] else main()
