"""Layer 0, used by every analysis: the model adapter (:mod:`.model_view`), the massive and
sink criteria (:mod:`.criterion`), in-hook reducers (:mod:`.reduce`), text sources
(:mod:`.corpora`), the result contract (:mod:`.results`), saving and loading results
(:mod:`.store`), pure drawing (:mod:`.render`) and number formatting (:mod:`.fmt`); importing it
also adds :mod:`.nnsight_view`'s view, so ``ModelView(lm)`` serves an nnsight model. Users
import from :mod:`massive_lens` and its public subpackages; ``core`` is what those are built on."""

from massive_lens.core import nnsight_view  # noqa: F401  (adds its view to ModelView.variants)
