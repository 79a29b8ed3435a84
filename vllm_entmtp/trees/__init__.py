"""Draft trees and the tree-set files that hold them (torch and pydantic only).

:mod:`vllm_entmtp.trees.tree` owns the :class:`Tree` (paths of top-k ranks in breadth-first order) and the tree
math the verification needs (parents, depths, the ancestor mask, the rows causal attention gets wrong);
:mod:`vllm_entmtp.trees.tree_sets` owns the tree-set JSON files (search folders, schema, validation, the
optional ``schedule``). Both are re-exported here, so ``from vllm_entmtp.trees import Tree, load_tree_set``
works; patch a function where it is defined (e.g. ``vllm_entmtp.trees.tree_sets.shipped_trees_dir``).
"""
from vllm_entmtp.trees.tree import Tree, children_lists, fix_rows_for, parse_inline_tree
from vllm_entmtp.trees.tree_sets import (NO_DRAFT_ID, SCHEMA_VERSION, TREES_ENV, Schedule, TreeSet, TreeSetFile,
                                         available_tree_sets, chains_only, load_tree_set, shipped_trees_dir, tree_search_dirs)

__all__ = ["NO_DRAFT_ID", "SCHEMA_VERSION", "TREES_ENV", "Schedule", "Tree", "TreeSet", "TreeSetFile",
           "available_tree_sets", "chains_only", "children_lists", "fix_rows_for", "load_tree_set", "parse_inline_tree",
           "shipped_trees_dir", "tree_search_dirs"]
