"""`SuffixDrafter`: several continuations at no model cost, from earlier occurrences of the text's latest tokens.

In the spirit of SuffixDecoding (Oliaro et al. 2024) and SAM-decoding (Hu et al. 2024): find every earlier
occurrence of the row's last n tokens (the longest n, up to ``max_ngram_size``, that occurs at all) in the prompt,
the text generated so far and an optional corpus of token ids; the tokens that followed each occurrence form a trie
of candidate continuations, each node weighted by the share of occurrences that pass through it. The tree keeps the
``num_nodes`` heaviest nodes (a node never outweighs its parent, so they form a tree), children in order of weight.

Every candidate is fixed by the prefix and the corpus, so its law is a point mass, and the tree rule
(`hf_spec.rejection.accept_tree`) tries them in order: the first with probability p(x), the next with the
target's probability renormalized without the tokens already rejected, and so on; exact under sampling and greedy.
Where this departs from SuffixDecoding: no suffix tree is kept across requests (the occurrences are searched afresh
each round, vectorized, which costs milliseconds at these lengths), and the tree is scored by frequency only.
"""

from __future__ import annotations

import heapq

import torch
import torch.nn.functional as F

from hf_spec.checks import check_int
from hf_spec.drafting.base import DraftContext, Proposal
from hf_spec.drafting.lookup import point_mass_proposal
from hf_spec.drafting.tree import DraftTree, TreeDrafter
from hf_spec.rows import RaggedBatch


class SuffixDrafter(TreeDrafter):
    """Args:
        max_ngram_size: the longest suffix of the text to match.
        min_ngram_size: the shortest; no occurrence of at least this length means no proposal.
        corpus: token-id sequences to search besides the row itself (documents the output is likely to copy).
        max_matches: the most recent occurrences used (in the row first, then the corpus).
    """

    def __init__(self, max_ngram_size: int = 4, min_ngram_size: int = 1,
                 corpus: list[torch.Tensor] | None = None, max_matches: int = 64):
        self.max_ngram_size = check_int("max_ngram_size", max_ngram_size)
        self.min_ngram_size = check_int("min_ngram_size", min_ngram_size)
        self.max_matches = check_int("max_matches", max_matches)
        if min_ngram_size > max_ngram_size:
            raise ValueError(f"`min_ngram_size` ({min_ngram_size}) must not exceed `max_ngram_size` "
                             f"({max_ngram_size}).")
        self.corpus = _check_corpus(corpus)

    def check(self, target, max_length: int) -> None:
        """The corpus's ids must be ids of the target's vocabulary."""
        vocab_size = target.config.get_text_config().vocab_size
        for document in self.corpus:
            if document.numel() and int(document.max()) >= vocab_size:
                raise ValueError(f"`corpus` holds id {int(document.max())}, but the model's vocabulary has "
                                 f"{vocab_size} ids (0 to {vocab_size - 1}); tokenize it with the target's tokenizer.")

    def propose_tree(self, batch: RaggedBatch, num_nodes: int, max_depth: int, context: DraftContext,
                     branching: int | None = None) -> DraftTree:
        if batch.num_active != 1:
            raise ValueError(f"SuffixDrafter trees are for one row, but {batch.num_active} rows are active.")
        row = batch.active_list[0]
        ids = batch.row_ids[row, : batch.lengths[row]]
        tokens, parents = heaviest_subtree(continuations(ids, self.corpus, self.max_ngram_size, self.min_ngram_size,
                                                         max_depth, self.max_matches), num_nodes, branching)
        device = ids.device
        token_ids = torch.tensor(tokens, dtype=ids.dtype, device=device)
        draft_probs = F.one_hot(token_ids, context.vocab_size).float() if context.do_sample else None
        return DraftTree(token_ids, parents, draft_probs, torch.zeros(2, dtype=torch.bool, device=device), 0)

    def propose(self, batch: RaggedBatch, num_draft_tokens: int, context: DraftContext) -> Proposal:
        """As a chain: each row's most frequent continuation."""
        chains = []
        for row in batch.active_list:
            ids = batch.row_ids[row, : batch.lengths[row]]
            found = continuations(ids, self.corpus, self.max_ngram_size, self.min_ngram_size, num_draft_tokens,
                                  self.max_matches)
            tokens, _ = heaviest_subtree(found, num_draft_tokens, branching=1)
            chains.append(torch.tensor(tokens, dtype=ids.dtype, device=ids.device))
        return point_mass_proposal(chains, batch, context)


def _check_corpus(corpus) -> list[torch.Tensor]:
    """``corpus`` as 1-D int64 tensors; an error naming ``corpus`` for anything but a list of token-id sequences."""
    if corpus is None:
        return []
    if isinstance(corpus, (str, bytes, torch.Tensor)) or not isinstance(corpus, (list, tuple)):
        raise ValueError(f"`corpus` must be a list of token-id sequences (lists or 1-D tensors of ids), but is a "
                         f"{type(corpus).__name__}.")
    documents = []
    for index, document in enumerate(corpus):
        if isinstance(document, (str, bytes)):
            raise TypeError(f"`corpus`[{index}] is text ({document[:40]!r}); the corpus holds token ids: tokenize it "
                            "with the target's tokenizer, `[tokenizer(text).input_ids for text in texts]`.")
        try:
            ids = torch.as_tensor(document)
        except (TypeError, ValueError, RuntimeError) as error:
            raise TypeError(f"`corpus`[{index}] must be a sequence of token ids, but is {type(document).__name__} "
                            f"({error}).") from None
        if ids.dim() != 1:
            raise ValueError(f"`corpus`[{index}] must be a 1-D sequence of token ids, but has shape "
                             f"{tuple(ids.shape)}.")
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise ValueError(f"`corpus`[{index}] must hold integer token ids, but holds {ids.dtype} values.")
        if ids.numel() and int(ids.min()) < 0:
            raise ValueError(f"`corpus`[{index}] holds a negative id ({int(ids.min())}).")
        documents.append(ids.long())
    return documents


def continuations(ids: torch.Tensor, corpus: list[torch.Tensor], max_ngram_size: int, min_ngram_size: int,
                  length: int, max_matches: int) -> list[list[int]]:
    """Up to ``length`` tokens after each of the latest ``max_matches`` earlier occurrences of ``ids``' longest
    matching suffix (row first, most recent first, then the corpus); empty when nothing of ``min_ngram_size`` recurs.

    Args:
        ids: ``[length]`` one row's tokens so far.
    """
    if length <= 0:
        return []
    for n in range(min(max_ngram_size, ids.shape[0] - 1), min_ngram_size - 1, -1):
        pattern = ids[-n:]
        found: list[list[int]] = []
        for source, end in [(ids, ids.shape[0] - 1), *((document.to(ids.device), None) for document in corpus)]:
            searched = source[:end]
            if searched.shape[0] <= n:
                continue
            windows = searched[:-1].unfold(0, n, 1) if end is None else searched.unfold(0, n, 1)
            starts = (windows == pattern).all(dim=1).nonzero().view(-1).flip(0)  # most recent first
            for start in starts[: max_matches - len(found)].tolist():
                found.append(source[start + n: start + n + length].tolist())
            if len(found) >= max_matches:
                break
        if found:
            return found
    return []


def heaviest_subtree(sequences: list[list[int]], num_nodes: int,
                     branching: int | None = None) -> tuple[list[int], list[int]]:
    """The ``num_nodes`` heaviest nodes of the trie of ``sequences`` as ``(tokens, parents)`` in topological order,
    a node's weight being how many sequences pass through it; siblings heaviest first (ties: the earlier sequence);
    at most ``branching`` children per node when given."""
    trie: dict[tuple[int, ...], list[int]] = {}  # prefix -> [count, index of first sequence]
    for index, sequence in enumerate(sequences):
        for depth in range(1, len(sequence) + 1):
            entry = trie.setdefault(tuple(sequence[:depth]), [0, index])
            entry[0] += 1
    tokens, parents, node_of = [], [], {(): -1}
    frontier = [(-count, first, prefix) for prefix, (count, first) in trie.items() if len(prefix) == 1]
    heapq.heapify(frontier)
    num_children: dict[tuple[int, ...], int] = {}
    while frontier and len(tokens) < num_nodes:
        _, _, prefix = heapq.heappop(frontier)
        parent = prefix[:-1]
        if branching is not None and num_children.get(parent, 0) >= branching:
            continue
        num_children[parent] = num_children.get(parent, 0) + 1
        node_of[prefix] = len(tokens)
        tokens.append(prefix[-1])
        parents.append(node_of[parent])
        for child, (count, first) in ((p, trie[p]) for p in _children_of(trie, prefix)):
            heapq.heappush(frontier, (-count, first, child))
    return tokens, parents


def _children_of(trie: dict[tuple[int, ...], list[int]], prefix: tuple[int, ...]) -> list[tuple[int, ...]]:
    return [key for key in trie if len(key) == len(prefix) + 1 and key[: len(prefix)] == prefix]
