"""Layer maps against the official index formulas and PKD's published layer sets."""
import pytest

from jax_tinybert.distill import layer_maps as lm


def official_tinybert(M, N):
    """TinyBERT task_distill.py: attention teacher j*k + k - 1 (0-based), hidden j*k (0 = emb)."""
    k = N // M
    att = [j * k + k - 1 for j in range(M)]
    rep = [j * k for j in range(M + 1)]
    return att, rep


@pytest.mark.parametrize("M,N", [(4, 12), (6, 12), (3, 6), (2, 6)])
def test_uniform_matches_official(M, N):
    m = lm.uniform(M, N)
    att0, rep = official_tinybert(M, N)
    assert m.student_attention_layers == tuple(range(1, M + 1))
    assert [t - 1 for t in m.teacher_attention_layers] == att0  # 1-based here
    assert m.student_hidden_layers == tuple(range(M + 1))
    assert list(m.teacher_hidden_layers) == rep
    assert m.name == "uniform"


def test_uniform_known_values():
    assert lm.uniform(4, 12).attention == ((1, 3), (2, 6), (3, 9), (4, 12))
    assert lm.uniform(3, 6).teacher_attention_layers == (2, 4, 6)  # oracle: 0-based 1, 3, 5
    assert lm.uniform(3, 6).teacher_hidden_layers == (0, 2, 4, 6)
    assert lm.uniform(2, 6).hidden == ((0, 0), (1, 3), (2, 6))


def test_pkd_published_sets():
    skip = lm.pkd_skip(6, 12)
    assert skip.teacher_hidden_layers == (2, 4, 6, 8, 10)
    assert [t - 1 for t in skip.teacher_hidden_layers] == [1, 3, 5, 7, 9]  # --fc_layer_idx
    assert skip.student_hidden_layers == (1, 2, 3, 4, 5)
    last = lm.pkd_last(6, 12)
    assert last.teacher_hidden_layers == (7, 8, 9, 10, 11)
    assert last.student_hidden_layers == (1, 2, 3, 4, 5)
    assert lm.pkd_skip(3, 6).hidden == ((1, 2), (2, 4))
    assert lm.pkd_last(3, 12).hidden == ((1, 10), (2, 11))


def test_top_bottom():
    assert lm.top(4, 12).attention == ((1, 9), (2, 10), (3, 11), (4, 12))
    assert lm.top(4, 12).hidden[0] == (0, 0)
    assert lm.bottom(4, 12).hidden == ((0, 0), (1, 1), (2, 2), (3, 3), (4, 4))
    assert lm.top(5, 12).teacher_attention_layers == (8, 9, 10, 11, 12)  # any M <= N


def test_from_spec():
    assert lm.from_spec("uniform", 4, 12) == lm.uniform(4, 12)
    assert lm.from_spec("pkd_last", 6, 12) == lm.pkd_last(6, 12)
    m = lm.from_spec([(0, 0), (1, 4), (2, 12)], 2, 12)
    assert m.hidden == ((0, 0), (1, 4), (2, 12))
    assert m.attention == ((1, 4), (2, 12))  # layer 0 has no attention
    m2 = lm.from_spec({"hidden": [[1, 2]], "attention": [[2, 5]]}, 2, 6)
    assert m2.attention == ((2, 5),) and m2.hidden == ((1, 2),)
    assert lm.from_spec(m2.to_spec(), 2, 6) == lm.LayerMap(2, 6, ((2, 5),), ((1, 2),))
    u = lm.uniform(3, 6)
    assert lm.from_spec(u, 3, 6) is u


@pytest.mark.parametrize("fn", [lambda M, N: lm.uniform(M, N, strict=True), lm.pkd_skip,
                                lambda M, N: lm.from_spec("uniform", M, N, strict=True)])
def test_non_divisible_raises_in_strict_mode(fn):
    with pytest.raises(ValueError, match=r"multiple of student layers \(5\).*\[1, 2, 3, 4, 6, 12\]"
                       r".*layer_map=0:0,1:2,2:5,3:7,4:10,5:12"):
        fn(5, 12)


def test_uniform_non_multiple_rounds_half_up():
    # g(m) = round(m N / M), halves up: the default 4-layer student under the 6-layer teacher.
    assert lm.uniform(4, 6).hidden == ((0, 0), (1, 2), (2, 3), (3, 5), (4, 6))
    assert lm.uniform(4, 6).attention == ((1, 2), (2, 3), (3, 5), (4, 6))
    assert lm.uniform(5, 12).teacher_hidden_layers == (0, 2, 5, 7, 10, 12)   # 2.4 4.8 7.2 9.6
    assert lm.uniform(3, 4).teacher_hidden_layers == (0, 1, 3, 4)            # 1.33 2.67
    with pytest.raises(ValueError, match="deeper"):
        lm.uniform(6, 4)


@pytest.mark.parametrize("N", range(1, 25))
def test_uniform_rule_properties(N):
    for M in range(1, N + 1):
        t = lm.uniform(M, N).teacher_hidden_layers
        assert t[0] == 0 and t[-1] == N and len(t) == M + 1
        assert all(a < b for a, b in zip(t, t[1:])), (M, N, t)      # distinct, increasing
        assert all(abs(g - m * N / M) <= 0.5 for m, g in enumerate(t))
        if N % M == 0:
            assert t == tuple(m * (N // M) for m in range(M + 1))   # TinyBERT's k * m


def test_compact_pair_syntax():
    m = lm.from_spec("0:0,1:2,2:3,3:5,4:6", 4, 6)
    assert m == lm.from_spec("((0,0),(1,2),(2,3),(3,5),(4,6))", 4, 6)
    assert m.hidden == lm.uniform(4, 6).hidden and m.attention == lm.uniform(4, 6).attention
    assert lm.from_spec(" 1:3 , 2:6 ", 2, 6).hidden == ((1, 3), (2, 6))
    assert lm.parse_pairs("0:0,1:12") == ((0, 0), (1, 12))
    for bad in ("0:0,1", "0:0,a:2", "0-0,1-2", ","):
        with pytest.raises(lm.LayerMapError, match="pair|no pairs"):
            lm.from_spec(bad if ":" in bad else bad + ":", 4, 6)
    with pytest.raises(ValueError, match="teacher layer 7.*0..6"):
        lm.from_spec("0:0,1:7", 4, 6)


def test_bad_maps_raise():
    with pytest.raises(ValueError, match="teacher layer 13.*0..12"):
        lm.from_spec([(1, 13)], 4, 12)
    with pytest.raises(ValueError, match="student layer 5.*0..4"):
        lm.from_spec([(5, 12)], 4, 12)
    with pytest.raises(ValueError, match="embeddings.*no attention"):
        lm.from_spec({"hidden": [], "attention": [(0, 0)]}, 4, 12)
    with pytest.raises(ValueError, match="pair"):
        lm.from_spec([(1, 2, 3)], 4, 12)
    with pytest.raises(ValueError, match="not a known map.*uniform"):
        lm.from_spec("skip", 4, 12)
    with pytest.raises(ValueError, match="deeper"):
        lm.top(6, 4)
    with pytest.raises(ValueError, match="num_student_layers"):
        lm.uniform(0, 12)
    with pytest.raises(ValueError, match="built for 4 -> 12"):
        lm.from_spec(lm.uniform(4, 12), 6, 12)
    with pytest.raises(ValueError, match="num_attention_heads"):
        lm.check_attention_heads(4, 12)
    lm.check_attention_heads(12, 12)


def test_explicit_pairs_from_a_command_line_string():
    # --config.objective.layer_map="((0,0),(1,2),...)" arrives as a string.
    m = lm.from_spec("((0,0),(1,2),(2,3),(3,5),(4,6))", 4, 6)
    assert m.hidden == ((0, 0), (1, 2), (2, 3), (3, 5), (4, 6))
    assert m.attention == ((1, 2), (2, 3), (3, 5), (4, 6))
    with pytest.raises(ValueError, match="does not parse"):
        lm.from_spec("((0,0),(1,", 4, 6)
