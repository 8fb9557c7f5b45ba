"""Which weights precompute loads for the reference and the policy, and what the cache records of them.

`--policy` is a full model (its own weights beside the reference's) or, for a LoRA run, a PEFT adapter folder
(precompute/adapters.py): then one copy of the base weights serves both sides, the reference's with the adapter
off and the policy's with it on (model/lora.py), as TRL's `disable_adapter()` does. `--model` may be an adapter
too (an SFT adapter over a base): its base's weights load, with that adapter on for the reference's side.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from klpipe.cache import Provenance
from klpipe.contract import LoadOptions, ScoringModel, Streaming
from klpipe.errors import InputError, ModelError
from klpipe.precompute import adapters, budget
from klpipe.precompute.config import PrecomputeConfig
from klpipe.precompute.verdict_key import Remembering, run_key
from klpipe.storage.verdicts import VerdictCache

if TYPE_CHECKING:
    from klpipe.model.loading import ModelSpec

REFERENCE = "reference"  # the adapter --model names, active on the reference's side
POLICY = "policy"  # the adapter --policy names, active on the policy's side
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass
class Models:
    """The weights to load, the adapters over them, and a policy with weights of its own where it has one."""

    spec: ModelSpec  # the weights the reference runs on (--model, or its base when --model is an adapter)
    adapters: list = field(default_factory=list)  # (name, folder, checked config) applied over spec's weights
    reference_side: str | None = None  # REFERENCE where --model is an adapter: active outside the policy's side
    policy_side: str | None = None  # POLICY where --policy is an adapter over spec's weights
    policy_spec: ModelSpec | None = None  # a --policy with weights of its own

    def folder(self, name: str) -> str:
        return next(path for side, path, _ in self.adapters if side == name)


def resolve(config: PrecomputeConfig) -> Models:
    """The models of `config`, every adapter checked (its config, its recorded base) before anything loads."""
    from klpipe import model as reference  # torch lives behind this import

    def spec(name, revision, device):
        return reference.ModelSpec(name=name, revision=revision, dtype=config.dtype, device=device,
                                   trust_remote_code=config.trust_remote_code)

    adapters.refuse_bare_weights("--model", config.model)
    adapters.refuse_bare_weights("--policy", config.policy)
    models = Models(spec(config.model, config.revision, config.device))
    if config.model is not None and adapters.is_adapter(config.model):
        models.spec = spec(adapters.base_to_load("--model", config.model), config.revision, config.device)
        models.adapters.append((REFERENCE, config.model, _read(config, "--model", config.model)))
        models.reference_side = REFERENCE
    if config.policy is not None and adapters.is_adapter(config.policy):
        for option, value in (("--policy-revision", config.policy_revision),
                              ("--policy-device", config.policy_device)):
            if value is not None and not (option == "--policy-device" and value == config.device):
                raise InputError(f"{option} does not apply to an adapter --policy: it runs on the reference's "
                                 "weights, on the reference's device")
        if config.model == adapters.recorded_base(config.policy):  # no --model: the base it records, found
            adapters.base_to_load("--policy", config.policy)
        fingerprint = base_fingerprint(models.spec)
        adapters.check_base("--policy", config.policy, models.spec.name, fingerprint, local_fingerprint)
        models.adapters.append((POLICY, config.policy, _read(config, "--policy", config.policy)))
        models.policy_side = POLICY
    elif config.policy is not None:
        models.policy_spec = spec(config.policy, config.policy_revision, config.policy_device or config.device)
    return models


@dataclass(frozen=True)
class Loaded:
    """The models a run scores with: the reference, and the policy where there is one (the reference itself where it
    is an adapter over the same weights, `policy_side` naming the adapter; else a model of its own)."""

    model: ScoringModel
    policy: ScoringModel | None
    policy_side: str | None

    @property
    def own(self) -> ScoringModel | None:
        """The policy where it has weights of its own."""
        return self.policy if self.policy is not None and self.policy is not self.model else None

    @property
    def distinct(self) -> list[ScoringModel]:
        """Each model loaded, once."""
        return [self.model] if self.own is None else [self.model, self.own]


def load_models(config: PrecomputeConfig, models: Models, recorded: Provenance,
                decided: budget.Streamed | budget.InMemory | None,
                verdicts: VerdictCache) -> tuple[Loaded, list[tuple[Remembering, ScoringModel]]]:
    """The reference and the policy, loaded as the budget `decided` (streamed or in memory, the tree's cache capped),
    each with what its checks decided kept at once; and each Remembering with its model, to keep again after the run.
    Both resident: each chunk's rows run through one, then the other, on one plan. An adapter policy is the same
    model with its adapter on: one copy of the base weights."""
    from klpipe import model as reference  # torch lives behind this import

    streamed = decided if isinstance(decided, budget.Streamed) else None  # None: in memory
    cache_mib = decided.cache_mib if decided is not None else None  # the budget's cap on the tree's cache
    remembered = Remembering(verdicts, run_key(config, models, recorded.revision, streamed is not None),
                             config.recheck)
    model = reference.ReferenceModel.load(models.spec, LoadOptions(
        config.compile, tuple(models.adapters), models.reference_side, streamed is not None,
        streamed.share() if streamed is not None else Streaming(), cache_mib, remembered))
    remembered.keep(model)
    remembering: list[tuple[Remembering, ScoringModel]] = [(remembered, model)]
    policy: ScoringModel | None = model if models.policy_side is not None else None
    if models.policy_spec is not None:
        # In the same share of the budget: its tree runs after the reference's. It streams where the budget said.
        policy_streams = streamed is not None and streamed.policy
        policy_remembered = Remembering(verdicts, run_key(config, models, recorded.policy_revision, policy_streams,
                                                          policy=True), config.recheck)
        if policy is None:
            policy = reference.ReferenceModel.load(models.policy_spec, LoadOptions(
                config.compile, streamed=policy_streams,
                streaming=streamed.share(policy=True) if streamed is not None and policy_streams else Streaming(),
                cache_mib=cache_mib, remembered=policy_remembered))
        policy_remembered.keep(policy)
        remembering.append((policy_remembered, policy))
    return Loaded(model, policy, models.policy_side), remembering


def _read(config: PrecomputeConfig, option: str, path: str) -> dict:
    """The adapter's checked config; one over a model class of its own (PEFT's auto_mapping: the base's remote code)
    only with --trust-remote-code, as for the base itself."""
    checked = adapters.read_config(path)
    if checked.get("auto_mapping") and not config.trust_remote_code:
        raise ModelError(f"{option} {path}: an adapter over a model that ships its own code "
                         f"({_class_of(checked['auto_mapping'])}); klpipe runs it only "
                         "with --trust-remote-code")
    return checked


def base_fingerprint(spec) -> str | None:
    from klpipe import model as reference

    return reference.weights_fingerprint(spec, reference.load_config(spec))


def local_fingerprint(path: str) -> str | None:
    from klpipe import model as reference

    return base_fingerprint(reference.ModelSpec(name=path))


def revision(models: Models, model_config) -> str | None:
    """The reference's weights as the cache records them: the base's fingerprint, and its adapter's bytes."""
    from klpipe import model as reference

    base = reference.weights_fingerprint(models.spec, model_config)
    if models.reference_side is None:
        return base
    return f"{base} + adapter {_adapter_fingerprint(models.folder(REFERENCE))}"


def policy_revision(models: Models, model_config, policy_config) -> str | None:
    """The policy's weights as the cache records them: an adapter's every byte over its base's fingerprint."""
    from klpipe import model as reference

    if models.policy_side is not None:
        base = reference.weights_fingerprint(models.spec, model_config)
        return f"{base} + adapter {_adapter_fingerprint(models.folder(POLICY))}"
    if models.policy_spec is not None:
        return reference.weights_fingerprint(models.policy_spec, policy_config)
    return None


def _adapter_fingerprint(path: str) -> str | None:
    """`local:` and a hash of the adapter folder's config and weight files (loading.WEIGHT_FILES)."""
    from klpipe import model as reference

    return reference.weights_fingerprint(reference.ModelSpec(name=path), None)


def check_tokenizers(config: PrecomputeConfig, models: Models, model_config, policy_config, ours: str,
                     fingerprint_of, what: str = "tokenizer") -> None:
    """The policy must read the reference's tokens as the same tokens: the same vocabulary and tokenizer. An adapter
    folder that holds a tokenizer (TRL saves one beside the adapter) must hold its base's.

    `ours`: the reference tokenizer's fingerprint; `fingerprint_of(spec)`: another's, by the same options; `what`
    the words for what they fingerprint (the chat template too, for conversational rows)."""
    from klpipe import model as reference

    for side, path, _ in models.adapters:
        if _has_tokenizer(path) and fingerprint_of(reference.ModelSpec(name=path)) != ours:
            option = "--model" if side == REFERENCE else "--policy"
            raise ModelError(f"{option} {path}: the adapter's {what} differs from its base's ({models.spec.name}); "
                             "the two must share a tokenizer, or the logprobs would be of other tokens")
    if models.policy_spec is None:
        return
    vocab, policy_vocab = reference.vocab_and_context(model_config)[0], reference.vocab_and_context(policy_config)[0]
    if vocab != policy_vocab:
        raise ModelError(f"--policy {config.policy}: its vocabulary has {policy_vocab} tokens and the reference's "
                         f"({config.model}) {vocab}; the two models must share a tokenizer")
    if fingerprint_of(models.policy_spec) != ours:
        raise ModelError(f"--policy {config.policy}: its {what} differs from the reference's ({config.model}); the "
                         "two models must share a tokenizer, or the policy's logprobs would be of other tokens")


def _has_tokenizer(path: str) -> bool:
    from pathlib import Path

    return any((Path(path).expanduser() / name).is_file() for name in TOKENIZER_FILES)


def _class_of(mapping) -> str:
    return str(mapping.get("base_model_class", "a custom class")) if isinstance(mapping, dict) else str(mapping)
