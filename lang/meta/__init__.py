"""Meta-generation strategies built on the language.

Each returns its answer and the `Cost` it incurred — calls, prompt / cached / generated
tokens from the meta_info of every request it made, and wall time:

- `best_of_n`: N samples of one prompt, the best by mean logprob or a scorer;
- `self_consistency`: N reasoning chains, majority vote over extracted answers;
- `tree_search`: step-wise beam search with a value function (Tree-of-Thoughts);
- `refine`: draft, critique, revise for k rounds.
"""

from sprig.cost import Cost, total
from sprig.meta.best import BestOfN, best_of_n
from sprig.meta.common import Samples, Scored, mean_output_logprob, sample
from sprig.meta.refinement import Refinement, refine
from sprig.meta.search import Path, SearchResult, tree_search
from sprig.meta.voting import Vote, answer_extractor, extract_answer, majority, self_consistency

__all__ = [
    "BestOfN",
    "Cost",
    "Path",
    "Refinement",
    "Samples",
    "Scored",
    "SearchResult",
    "Vote",
    "answer_extractor",
    "best_of_n",
    "extract_answer",
    "majority",
    "mean_output_logprob",
    "refine",
    "sample",
    "self_consistency",
    "total",
    "tree_search",
]
