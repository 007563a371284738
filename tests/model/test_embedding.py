"""The token embedding looked up in GGUF blocks: rows bit-equal to gguf's dequantized table,
for every block type the kernel reads (a Llama Q4_K_M stores its embedding as Q4_K or Q6_K),
as the file holds them and as repacked."""

from __future__ import annotations

import pytest
import torch

from engine.model import quant_kernel as qk
from engine.model.embedding import Embedding
from engine.model.gguf_weights import QuantWeight
from tests.model.test_quant_kernel import random_blocks, reference_dequantize

pytestmark = pytest.mark.skipif(not qk.quant_kernel_available(), reason="the C++ GGUF kernel does not build here")


@pytest.mark.parametrize("qtype", qk.GGUF_TYPES)
def test_rows_from_blocks_equal_the_dequantized_table(qtype):
    blocks = random_blocks(qtype, 40, 512, seed=7)
    table = reference_dequantize(blocks, qtype)  # [40, 512]
    ids = torch.tensor([3, 0, 39, 3, 17])
    got = Embedding(blocks=QuantWeight(blocks, qtype, "token_embd.weight"))(ids)
    assert torch.equal(got, table[ids])
    packed, packed_type, scales = qk.repack(blocks, qtype)  # a k-quant as the model keeps it, with its scales
    got = Embedding(blocks=QuantWeight(packed, packed_type, "token_embd.weight", scales))(ids)
    assert torch.equal(got, table[ids])
    assert torch.equal(Embedding(table)(ids), table[ids])


def test_an_embedding_is_a_table_or_blocks():
    with pytest.raises(ValueError, match="exactly one"):
        Embedding()
