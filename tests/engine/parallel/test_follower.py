"""What a rank other than 0 answers when rank 0 asks about disk pages before a restore."""

import time

import mlx.core as mx

from mlxkv import KVCacheManager
from mlxkv.cache.disk import DiskSpec
from mlxkv.engine.parallel.follower import answer_disk_question
from mlxkv.engine.parallel.step_plan import DiskQuestion

TOKENS = list(range(10, 19))  # 9 tokens: 2 full pages of 4 before the last


def test_a_rank_says_which_pages_it_lacks_and_reads_the_others_until_they_are_ready(tmp_path):
    cache = KVCacheManager(
        1, 1, 8, max_num_seqs=1, max_model_len=32, page_size=4, dtype=mx.float16, disk=DiskSpec(tmp_path, 10**9, "m")
    )
    (seq,) = cache.claim(1)
    batch = cache.append([seq], [len(TOKENS)])
    cache.write(0, batch, mx.ones((9, 1, 8), mx.float16), mx.ones((9, 1, 8), mx.float16))
    cache.evaluate()
    cache.publish([seq], [TOKENS], [len(TOKENS)])
    assert cache.disk.flush(10)
    question = DiskQuestion([*cache.prompt_keys(TOKENS), bytes(32)])  # its two pages, and one it never had
    answers = [answer_disk_question(cache, question)]
    while answers[-1][0].any() and len(answers) < 1000:  # the reader thread reads the file meanwhile
        time.sleep(0.01)
        answers.append(answer_disk_question(cache, question))
    assert [a[1].tolist() for a in answers] == [[0, 0, 1]] * len(answers)  # lacking: the third alone
    assert answers[-1][0].tolist() == [0, 0, 0]  # and nothing left to read

    bare = KVCacheManager(1, 1, 8, max_num_seqs=1, max_model_len=32, page_size=4)  # no disk tier: it lacks all
    assert [flags.tolist() for flags in answer_disk_question(bare, question)] == [[0, 0, 0], [1, 1, 1]]
