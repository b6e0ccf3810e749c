"""Every public name of transcover.approx imports, and the README's task example runs."""

import torch

import transcover.approx as approx


def test_all_names_import():
    for name in approx.__all__:
        assert getattr(approx, name) is not None, name
    assert len(set(approx.__all__)) == len(approx.__all__)


def test_readme_example():
    X, y = approx.make_sparse_task("holder", n_samples=32, seq_len=16, sparsity=2, beta=1.0, seed=0)
    target = approx.sparse_target("holder", 16, sparsity=2, beta=1.0, seed=0)
    assert X.shape == (32, 16, 1) and len(target.indices) == 2
    torch.testing.assert_close(target(X.double()).float(), y)
