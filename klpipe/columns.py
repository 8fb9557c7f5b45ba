"""Column roles and the user's names for them: `--column ROLE=NAME`.

klpipe asks for columns by role. A role's default name is the cache contract's (klpipe/cache.py);
`--column response_ids=completion_ids --column reward=score` points roles at the columns of a
verl, OpenRLHF or TRL dump instead, so it works without a rewrite. Outputs keep the user's names.
A cache records the mapping its precompute used (provenance `columns`), so `klpipe score` finds
the reference logprobs and every other role of a mapped cache without being told again.

Pure Python and pyarrow: both stages import this.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pyarrow as pa

from klpipe import cache
from klpipe.errors import InputError, ProvenanceError

if TYPE_CHECKING:
    from klpipe.storage.store import Location

# Every role, in the order messages list them.
ROLES: dict[str, str] = {
    cache.ID: "names rows in messages",
    cache.STEP: "groups rows into controller batches",
    cache.PROMPT: "prompt text, or TRL conversational messages",
    cache.RESPONSE: "response text, or TRL conversational completion messages",
    cache.PROMPT_IDS: "prompt token ids",
    cache.RESPONSE_IDS: "response token ids",
    cache.POLICY_LOGPROBS: "the sampling policy's logprob of each response token (with --policy, the trainer's)",
    cache.SAMPLER_LOGPROBS: "the sampler's own logprobs, kept beside the trainer's policy_logprobs (Atropos' "
                            "inference_logprobs, verl's rollout_log_probs)",
    cache.REWARD: "each rollout's reward",
    cache.REF_LOGPROBS: "the reference logprobs precompute writes and score reads",
    cache.MASK: "1 where the policy sampled the response token, 0 for a tool's result (TRL tool_mask, env_mask)",
    cache.TOOLS: "the tool schemas a conversational row's chat template rendered",
}

# Other default names a role answers to when neither its own name nor a mapping is there:
# TRL's prompt-completion datasets call the response `completion`.
# TRL's GRPOTrainer calls the mask `tool_mask` (tools=) or `env_mask` (rollout_func).
ALIASES: dict[str, tuple[str, ...]] = {cache.RESPONSE: (cache.COMPLETION,), cache.MASK: cache.TRL_MASKS}

# Roles for which two candidate columns in one file are an error rather than a preference: taking
# the wrong mask would silently score other tokens.
AMBIGUOUS_ROLES = (cache.MASK,)

EXAMPLE = "--column reward=score"


def parse_columns(specs: Iterable[str] | None) -> dict[str, str]:
    """`["reward=score", ...]` as {role: column}; each spec as the user wrote it appears in errors."""
    mapping: dict[str, str] = {}
    given: dict[str, str] = {}
    for spec in specs or ():
        role, sep, name = spec.partition("=")
        role, name = role.strip(), name.strip()
        if not sep or not role or not name:
            raise InputError(f"--column {spec}: expected ROLE=NAME, e.g. {EXAMPLE}")
        if role in mapping and mapping[role] != name:
            raise InputError(f"--column {given[role]} and --column {spec}: one column per role")
        mapping[role], given[role] = name, spec
    ColumnMap(mapping)  # checks roles and clashes
    return mapping


@dataclass(frozen=True)
class ColumnMap:
    """Role → the user's column name. Roles not in `given` keep their default name (or an alias)."""

    given: dict[str, str] = field(default_factory=dict)  # what the user asked for; recorded in caches
    aliases: dict[str, str] = field(default_factory=dict)  # set by `resolve` from the schema

    def __post_init__(self) -> None:
        unknown = [role for role in self.given if role not in ROLES]
        if unknown:
            role = unknown[0]
            raise InputError(f"--column {role}={self.given[role]}: unknown role {role!r}; "
                             f"roles are {', '.join(ROLES)}")
        by_name: dict[str, str] = {}
        for role, name in self.given.items():
            if name in by_name:
                raise InputError(f"--column {by_name[name]}={name} and --column {role}={name}: "
                                 "two roles cannot share one column")
            by_name[name] = role

    def name(self, role: str) -> str:
        """The column that holds `role` in the user's files."""
        return self.given.get(role) or self.aliases.get(role) or role

    def resolve(self, schema: pa.Schema, path: object = None) -> ColumnMap:
        """This map with aliases picked for unmapped roles whose default name `schema` lacks.

        For an ambiguous role (the mask) two candidate columns in `path` are an error listing them.
        """
        aliases = {}
        for role, alternatives in ALIASES.items():
            if role in self.given:
                continue
            if role in AMBIGUOUS_ROLES:
                found = [name for name in (role, *alternatives) if name in schema.names]
                if len(found) > 1:
                    raise InputError(f"{path}: columns {' and '.join(found)} could each be the {role}; "
                                     f"name the one to use with --column {role}={found[0]}")
            elif role in schema.names:
                continue
            found = [name for name in alternatives if name in schema.names]
            if found:
                aliases[role] = found[0]
        return ColumnMap(self.given, aliases)

    def check_present(self, path: Location, schema: pa.Schema, outputs: tuple[str, ...] = ()) -> None:
        """Every mapped column must exist (but the `outputs` roles, which this stage writes)."""
        for role, name in self.given.items():
            if role not in outputs and name not in schema.names:
                raise InputError(f"{path}: --column {role}={name}: no column {name!r}; "
                                 f"found {', '.join(schema.names) or 'none'}")


def for_caches(given: dict[str, str], files: Sequence[Location]) -> ColumnMap:
    """Score's map: the mapping the caches were made with, overridden role by role by `given`.

    Caches scored together must have been made with one mapping, or their roles could sit in
    different columns.
    """
    recorded: dict[str, str] | None = None
    first = None
    for path in files:
        provenance = cache.read_provenance(path)
        columns = dict(provenance.columns) if provenance is not None else {}
        if recorded is None:
            recorded, first = columns, path
        elif columns != recorded:
            raise ProvenanceError(
                f"caches disagree on columns: {first} was made with {_describe(recorded)}, {path} with "
                f"{_describe(columns)}; score caches made with one column mapping at a time"
            )
    return ColumnMap({**(recorded or {}), **given})


def _describe(mapping: dict[str, str]) -> str:
    if not mapping:
        return "no --column"
    return " ".join(f"--column {role}={name}" for role, name in sorted(mapping.items()))
