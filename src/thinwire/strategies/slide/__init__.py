"""Distributed SLIDE: LSH tables (:mod:`.lsh`), the sparse layer (:mod:`.layer`) and the
sharded method (:mod:`.method`, registered as ``slide``)."""
