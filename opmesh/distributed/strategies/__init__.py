"""The parallel strategies, each written once over an operator's description.

An operator on a mesh is described by a table (``description.OpTable``): which tensors it
takes, each tensor's named dims per layout (the batch ``B``, the query sequence ``S1``/``T1``,
the key sequence ``S2``/``T2``, heads, head dims, the top-k dim), which arguments carry the
sequence lengths, and how its outputs join. The strategies read only that table:

* ``description``: the tables' vocabulary (a tensor's side and sequence dim, lengths given as
  DTensors, the partial sums of gradients of inputs replicated where the rows are split);
* ``data_parallel``: batch slices and TND whole-sequence shards (each rank its own sequences);
* ``heads``: head parallel, including fewer key heads than ranks (the key heads each rank's
  query heads need, and how often to repeat them for an all-to-all);
* ``all_gather``: context parallel by all-gather: the key-side tensors gathered over the query
  sequence's mesh axes, and the one mapping from a rank's query rows (contiguous or head-tail)
  to the pieces it computes, each with the keys its rows keep;
* ``ring``: context parallel with the keys passed around the group;
* ``ulysses``: context parallel by all-to-all (sequence shards to head shards and back), and the
  hybrids that run a second strategy over a second mesh axis.

The operator families (``opmesh/distributed/ops/``) hold their tables, choose a strategy per
call, and write a piece's lengths into their own arguments.
"""
