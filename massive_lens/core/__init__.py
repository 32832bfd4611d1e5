"""Layer 0, used by every analysis: the model adapter (:mod:`.model_view`), the massive and
sink criteria (:mod:`.criterion`), in-hook reducers (:mod:`.reduce`), text sources
(:mod:`.corpora`), the result contract (:mod:`.results`), saving and loading results
(:mod:`.store`), pure drawing (:mod:`.render`) and number formatting (:mod:`.fmt`); the nnsight
view (:mod:`.nnsight_view`) is registered by :mod:`massive_lens.models.backends`, so importing
``core`` changes nothing. Users import from :mod:`massive_lens` and its public subpackages;
``core`` is what those are built on."""
