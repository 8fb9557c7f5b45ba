"""verl 0.9.1's own ToolAgentLoop, run offline: the truth for `--rollout-format verl` on `agent_data.messages`.

Every line of the loop is verl's: `ToolAgentLoop` (verl/experimental/agent_loop/tool_agent_loop.py) with its state
machine, `_build_assistant_message`, `_call_tool` and `max_parallel_calls`; the hermes tool parser
(tool_parser.py); the Continuous Token builder (verl/utils/tokenizer/continuous_token.py) behind `AgentLoopBase`'s
`ct_*` methods; tools as `BaseTool` subclasses. What needs ray, hydra or a model server is left out: the package
`__init__` files (they import ray), and from agent_loop.py only `AgentLoopOutput`, `ToolListWrap`, `DictConfigWrap`,
`AgentLoopBase`, `AgentLoopMetrics` and `register` are
taken (their source, compiled as verl ships it; the rest of that module is the
ray worker). Three modules whose few names the loop uses are stood in: `ray_utils.get_event_loop`, `profiler.
simple_timer` and `replica.TokenOutput`, each a one-liner with verl's behaviour.

The one other stand-in is the generation engine (`Engine`): it returns the token ids the policy "sampled", scripted
per turn as raw text a sampler can write (compact JSON, two calls, a turn without EOS), cut at `max_tokens` as verl's
server does (each turn's limit is `response_length`).

make test-trl installs the wheel into a folder of its own (VERL_DIR, default .venv/verl), never into the venv's
site-packages: the wheel ships a top-level `tests` package that would shadow this one.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import json
import os
import sys
import types
from pathlib import Path
from typing import Any, Optional

import pytest

VERL_PACKAGES = ("verl", "verl.utils", "verl.experimental", "verl.experimental.agent_loop", "verl.tools",
                 "verl.workers", "verl.workers.rollout")
AGENT_LOOP_NAMES = ("AgentLoopMetrics", "AgentLoopOutput", "DictConfigWrap", "ToolListWrap", "AgentLoopBase",
                    "register", "_agent_loop_registry", "logger")


def verl_root() -> Path:
    root = Path(os.environ.get("VERL_DIR", Path(sys.prefix) / "verl")) / "verl"
    if not (root / "experimental" / "agent_loop" / "tool_agent_loop.py").is_file():
        pytest.fail(f"verl is not installed in {root.parent}: run make test-trl, which installs it")
    return root


def load_verl():
    """verl's modules: (tool_agent_loop, base_tool, schemas)."""
    root = verl_root()
    for name in VERL_PACKAGES:
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [str(root.joinpath(*name.split(".")[1:]))]
            sys.modules[name] = package
    if "verl.utils.ray_utils" not in sys.modules:
        stand_in("verl.utils.ray_utils", get_event_loop=asyncio.get_event_loop)
        stand_in("verl.utils.profiler", simple_timer=lambda name, timing: contextlib.nullcontext())
        from pydantic import BaseModel

        class TokenOutput(BaseModel):  # verl/workers/rollout/replica.py's fields
            token_ids: list[int]
            log_probs: list[float] | None = None
            routed_experts: Any | None = None
            stop_reason: str | None = None
            num_preempted: int | None = None
            extra_fields: dict[str, Any] = {}

        stand_in("verl.workers.rollout.replica", TokenOutput=TokenOutput)
        agent_loop_module(root)
    from verl.experimental.agent_loop import tool_agent_loop
    from verl.tools import base_tool, schemas

    return tool_agent_loop, base_tool, schemas


def stand_in(name: str, **names) -> None:
    module = types.ModuleType(name)
    module.__dict__.update(names)
    sys.modules[name] = module


def agent_loop_module(root: Path) -> types.ModuleType:
    """verl's agent_loop.py, its classes the tool loop uses, compiled from verl's source (imports left out)."""
    import logging
    from abc import ABC, abstractmethod

    import numpy as np
    import torch
    from PIL import Image
    from pydantic import BaseModel, ConfigDict
    from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

    path = root / "experimental" / "agent_loop" / "agent_loop.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    kept = [node for node in tree.body if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.Assign, ast.AnnAssign))
            and _names(node) & set(AGENT_LOOP_NAMES)]
    module = types.ModuleType("verl.experimental.agent_loop.agent_loop")
    module.__dict__.update(asyncio=asyncio, logging=logging, os=os, ABC=ABC, abstractmethod=abstractmethod, Any=Any,
                           Optional=Optional, np=np, torch=torch, Image=Image, BaseModel=BaseModel,
                           ConfigDict=ConfigDict, create_continuous_token_builder=create_continuous_token_builder,
                           get_event_loop=asyncio.get_event_loop, __file__=str(path))
    # Annotations name ray-side types (LLMServerClient, RLHFDataset, DictConfig): left unevaluated, as they are unused.
    code = compile(ast.Module(body=kept, type_ignores=[]), str(path), "exec",
                   flags=__import__("__future__").annotations.compiler_flag, dont_inherit=True)
    sys.modules[module.__name__] = module  # pydantic resolves the annotations in the module's namespace
    exec(code, module.__dict__)  # noqa: S102 - verl's own source, from its released wheel
    return module


def _names(node) -> set[str]:
    if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
        return {node.name}
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    return {t.id for t in targets if isinstance(t, ast.Name)}


class Engine:
    """The generation engine: each call returns the next scripted turn's ids, cut at max_tokens."""

    def __init__(self, turns: list[list[int]], response_length: int):
        self.turns = list(turns)
        self.response_length = response_length

    async def generate(self, request_id, prompt_ids, sampling_params, **_):
        from verl.workers.rollout.replica import TokenOutput

        limit = sampling_params.get("max_tokens", self.response_length)  # verl's server: response_length per turn
        return TokenOutput(token_ids=self.turns.pop(0)[:limit])


class Config(dict):
    """The slice of verl's hydra config the loop reads, with attribute access as DictConfig has."""

    def __getattr__(self, key):
        return self[key]


def tool_classes(base_tool, schemas):
    """Two verl BaseTool subclasses: weather, and clock (which returns `text` `times` over when given it)."""

    class Weather(base_tool.BaseTool):
        async def execute(self, instance_id, parameters, **kwargs):
            return schemas.ToolResponse(text=f"18 C and sunny in {parameters['city']}"), 0.0, {}

    class Clock(base_tool.BaseTool):
        async def execute(self, instance_id, parameters, **kwargs):
            text = parameters.get("text", f"14:05 in {parameters.get('city')}") * parameters.get("times", 1)
            return schemas.ToolResponse(text=text), 0.0, {}

    def schema(name):
        return schemas.OpenAIFunctionToolSchema.model_validate({
            "type": "function", "function": {"name": name, "description": f"The {name} in a city.", "parameters": {
                "type": "object", "properties": {"city": {"type": "string", "description": "The city."}},
                "required": ["city"]}}})

    return [Weather(config={}, tool_schema=schema("weather")), Clock(config={}, tool_schema=schema("clock"))]


def run(tokenizer, model_type: str, prompt: list[dict], turns: list[str], *, max_parallel_calls: int = 1,
        response_length: int = 512, max_tool_response_length: int = 256) -> dict:
    """verl's ToolAgentLoop on `prompt`, the engine sampling `turns` (raw text, tokenized as the policy's tokens):
    verl's prompt_ids, response_ids, response_mask, and agent_data.messages as the loop left them."""
    tool_agent_loop, base_tool, schemas = load_verl()
    agent_loop = sys.modules["verl.experimental.agent_loop.agent_loop"]
    multi_turn = Config(max_user_turns=None, max_assistant_turns=None, max_parallel_calls=max_parallel_calls,
                        max_tool_response_length=max_tool_response_length, tool_response_truncate_side="middle",
                        format="hermes")
    rollout = Config(multi_turn=multi_turn, prompt_length=1024, response_length=response_length,
                     full_determinism=False)
    config = Config(actor_rollout_ref=Config(rollout=rollout))
    engine = Engine([tokenizer.encode(text, add_special_tokens=False) for text in turns], response_length)
    captured = {}

    class Loop(tool_agent_loop.ToolAgentLoop):
        async def _handle_pending_state(self, agent_data, sampling_params):
            captured["agent_data"] = agent_data  # the messages a user saves are agent_data.messages
            return await super()._handle_pending_state(agent_data, sampling_params)

    async def main():
        loop = Loop(trainer_config=agent_loop.DictConfigWrap(config), server_manager=engine, tokenizer=tokenizer,
                    processor=None, dataset_cls=None, data_config=agent_loop.DictConfigWrap(Config()),
                    hf_model_type=model_type, tools=agent_loop.ToolListWrap(tool_classes(base_tool, schemas)))
        return await loop.run({}, raw_prompt=prompt)

    output = asyncio.run(main())
    messages = captured["agent_data"].messages
    schemas_json = [tool.tool_schema.model_dump(exclude_unset=True, exclude_none=True)
                    for tool in tool_classes(base_tool, schemas)]
    return {"prompt_ids": list(output.prompt_ids), "response_ids": list(output.response_ids),
            "response_mask": list(output.response_mask), "messages": messages, "tools": schemas_json,
            "saved": json.loads(json.dumps(messages[len(prompt):]))}
