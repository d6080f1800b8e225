"""lens_callbacks.process (pure torch/numpy; never imports lightning).

The outcome→process reward instrument (the spec's G3): a prefix trie over each group's completions,
the Monte-Carlo values ``q(s)``, the process rewards they induce, and the kill condition.
"""

from .instrument import REMEDY, InducedProcessReward, ProcessAudit, RolloutGroup, audit_groups, induced_process_reward
from .sources import groups_from_dump, groups_from_record, groups_from_terms, load_groups
from .trie import PrefixTrie, TrieNode

__all__ = [
    "induced_process_reward",
    "audit_groups",
    "InducedProcessReward",
    "ProcessAudit",
    "RolloutGroup",
    "REMEDY",
    "PrefixTrie",
    "TrieNode",
    "groups_from_terms",
    "groups_from_record",
    "groups_from_dump",
    "load_groups",
]
