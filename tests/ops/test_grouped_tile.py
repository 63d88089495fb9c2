"""The untuned grouped products' tile width (rocmoe.ops.gpu.even_block_n): no ragged N tile
where a narrower power-of-two tile divides N (a 1408-wide product ran 10x slower on 256-wide
tiles than on 128-wide ones on an H200)."""

from rocmoe.ops.gpu import even_block_n


def test_a_width_that_divides_n_is_kept():
    assert even_block_n(4096, 256) == 256


def test_the_widest_dividing_tile_replaces_a_ragged_one():
    assert even_block_n(1408, 256) == 128      # 11 x 128
    assert even_block_n(1344, 256) == 64       # 21 x 64


def test_no_dividing_tile_keeps_the_default():
    assert even_block_n(1000, 256) == 256      # 1000 = 8 x 125: nothing >= 64 divides it


def test_small_interpreter_tiles_go_no_lower_than_themselves():
    assert even_block_n(40, 16) == 16 and even_block_n(24, 16) == 16
