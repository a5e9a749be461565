"""Images in the paged batch: mlx-vlm's greedy tokens for prompts with one and two images, alone and
batched with text requests, in both layouts; and a prefix cache that tells images apart."""

import warnings

import numpy as np
import pytest

from mlxkv import LLM, SamplingParams
from mlxkv.engine.images import ImagePrompt
from mlxkv.models.random_vision_model import VISION_TYPES, make_vision_checkpoint

mlx_vlm = pytest.importorskip("mlx_vlm")
pytestmark = [pytest.mark.filterwarnings("ignore"), pytest.mark.xdist_group("images")]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
QUESTION = "Describe the image."


def picture(seed: int, size=(48, 64)):
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def checkpoint(tmp_path_factory, model_type):
    """A tiny random checkpoint of `model_type`, a prompt with n images as mlx-vlm's chat template
    writes it (`prompt.prefaced(n)`: with text before them), and mlx-vlm's greedy tokens for it."""
    path = make_vision_checkpoint(tmp_path_factory.mktemp(model_type), model_type)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, processor = mlx_vlm.load(str(path))

    def prompt(n: int, question: str = QUESTION) -> str:
        return mlx_vlm.apply_chat_template(processor, model.config, question, num_images=n)

    def prefaced(n: int) -> str:
        """A prompt with text before its images, so that pages fill before the first placeholder."""
        content = [{"type": "text", "text": "Here is a photo from our trip to the coast last week. "}]
        content += [{"type": "image"}] * n + [{"type": "text", "text": QUESTION}]
        messages = [{"role": "user", "content": content}]
        return processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def reference(n: int, images) -> list[int]:
        """mlx-vlm's greedy tokens: its last response holds them all."""
        *_, last = mlx_vlm.stream_generate(model, processor, prompt(n), image=list(images), max_tokens=8, temperature=0)
        return list(last.token_ids)

    prompt.prefaced = prefaced
    return path, prompt, reference


@pytest.fixture(scope="module", params=VISION_TYPES)
def family(request, tmp_path_factory):
    return checkpoint(tmp_path_factory, request.param)


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
def test_tokens_equal_mlx_vlm_with_one_and_two_images_alone_and_batched(family, layout):
    path, prompt, reference = family
    images = [picture(1), picture(2, (64, 48))]
    expected = {n: reference(n, images[:n]) for n in (1, 2)}
    llm = LLM(str(path), kv_layout=layout, max_num_seqs=8, page_size=8)
    texts = ["The sky is", "Once upon a time"]
    alone = {t: llm.generate(t, GREEDY)[0].token_ids for t in texts}
    for n in (1, 2):
        (done,) = llm.generate(ImagePrompt(prompt(n), images[:n]), GREEDY, continuation=False)
        assert done.token_ids == expected[n]
    batch = [texts[0], ImagePrompt(prompt(1), images[:1]), texts[1], ImagePrompt(prompt(2), images)]
    done = llm.generate(batch, GREEDY, continuation=False)
    assert [d.token_ids for d in done] == [alone[texts[0]], expected[1], alone[texts[1]], expected[2]]
    assert llm.stats().kv.pages_used == 0


def test_sixteen_images_behind_the_same_text_get_sixteen_answers(family):
    """vllm-mlx keyed its prefix cache on token ids alone and answered every page with the first
    image's reply: here each request's answer is its cold run's."""
    path, prompt, _ = family
    images = [picture(100 + i) for i in range(16)]
    cold = LLM(str(path), prefix_caching=False, max_num_seqs=16)
    runs = [cold.generate(ImagePrompt(prompt(1), [image]), GREEDY, continuation=False)[0] for image in images]
    expected = [run.token_ids for run in runs]
    assert len({tuple(tokens) for tokens in expected}) > 1  # the images do change the answer
    warm = LLM(str(path), max_num_seqs=16, page_size=8)
    warm.generate(ImagePrompt(prompt(1), images[:1]), GREEDY, continuation=False)  # cached: the first image's pages
    done = warm.generate([ImagePrompt(prompt(1), [image]) for image in images], GREEDY, continuation=False)
    assert [d.token_ids for d in done] == expected


def test_the_same_image_reuses_every_page_and_another_only_those_before_it(family):
    path, prompt, _ = family
    llm = LLM(str(path), max_num_seqs=4, page_size=8)
    text = prompt.prefaced(1)
    first = llm.engine.place_images(ImagePrompt(text, [picture(7)]))
    placeholder = int(first.images.images[0].placeholders[0])
    assert placeholder >= 8  # a page or more before the image
    llm.generate(ImagePrompt(text, [picture(7)]), GREEDY, continuation=False)
    (again,) = llm.generate(ImagePrompt(text, [picture(7)]), GREEDY, continuation=False)
    assert again.num_cached_tokens == (len(first) - 1) // 8 * 8  # every full page but the one with the last token
    (other,) = llm.generate(ImagePrompt(text, [picture(8)]), GREEDY, continuation=False)
    if llm.stats().kv.states_total:  # a hybrid (Qwen3.5) keeps its recurrent state only past the image
        assert other.num_cached_tokens == 0  # (at the prompt's snapshot point): no page before it is reusable
    else:
        assert other.num_cached_tokens == placeholder // 8 * 8  # the pages before the image's first placeholder


def test_images_the_step_reserve_cannot_encode_are_refused_in_one_line(family):
    """Each image is encoded inside a step, within the step reserve: one that would need more is
    refused when it is added, naming the images and the reserve, and nothing else changes."""
    from dataclasses import replace

    path, prompt, _ = family
    llm = LLM(str(path))
    llm.engine.memory = replace(llm.engine.memory, reserve=1000)
    with pytest.raises(ValueError, match=r"^images: 2 images, the largest of \d+ placeholders, need about 0\.00 GB"):
        llm.generate(ImagePrompt(prompt(2), [picture(1), picture(2)]), GREEDY)
    assert llm.stats().running == llm.stats().waiting == 0 and llm.stats().kv.pages_used == 0


def test_a_model_handed_to_a_second_engine_gives_the_same_tokens(family):
    """The runner wraps the model's layers (M-RoPE, deepstack) around mlx-lm's own modules, afresh
    for each engine: a second one must not stack its wrappers on the first's."""
    from mlxkv import load

    path, prompt, reference = family
    images = [picture(1)]
    loaded = load(str(path))
    for _ in range(2):
        (done,) = LLM(loaded).generate(ImagePrompt(prompt(1), images), GREEDY, continuation=False)
        assert done.token_ids == reference(1, images)


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    return checkpoint(tmp_path_factory, "gemma4")


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
def test_gemma4_sees_each_image_whole_where_a_chunk_would_end_inside_it(gemma4, layout):
    """Gemma 4 attends both ways within an image (its released checkpoints' `use_bidirectional_attention`):
    with a budget of 16 tokens a step, chunks that would end inside an image stop before it, and
    the tokens are still mlx-vlm's (which prefills the prompt in one piece); attending causally
    within the image, they would not be."""
    path, prompt, reference = gemma4
    images = [picture(1), picture(2, (64, 48))]
    expected = {n: reference(n, images[:n]) for n in (1, 2)}
    llm = LLM(str(path), kv_layout=layout, max_num_seqs=2, max_num_batched_tokens=16, page_size=8)
    blocks = llm.engine.place_images(ImagePrompt(prompt(2), images)).images.blocks
    assert [end - first for first, end in blocks] == [12, 12] and blocks[0][0] < 16 < blocks[0][1]
    for n in (1, 2):
        (done,) = llm.generate(ImagePrompt(prompt(n), images[:n]), GREEDY, continuation=False)
        assert done.token_ids == expected[n]
    llm.engine.vision.both_ways = False  # causal within the image, as mlxkv was before (and none of its pages)
    (causal,) = llm.generate(ImagePrompt(prompt(2), images), GREEDY, continuation=False, cache_salt="causal")
    assert causal.token_ids != expected[2]
    assert llm.stats().kv.pages_used == 0


def test_gemma4_continues_a_cached_prefix_that_ends_inside_an_image(gemma4):
    """A cached prefix whose later pages were evicted may end inside an image: its pages hold K/V
    computed with the whole image, the rest of the image is computed seeing all of it, and the
    tokens are still mlx-vlm's."""
    from mlxkv.cache.prefix_cache import chain_keys, root_key

    path, prompt, reference = gemma4
    llm = LLM(str(path), max_num_seqs=2, page_size=4)
    request = ImagePrompt(prompt(1), [picture(1)])
    placed = llm.engine.place_images(request)
    (first, stop), expected = placed.images.blocks[0], reference(1, [picture(1)])
    assert llm.generate(request, GREEDY, continuation=False)[0].token_ids == expected
    middle = (first + stop) // 2 // 4  # the page holding the image's middle
    assert first < middle * 4 < stop
    pool = llm.engine.cache.pool
    for key in chain_keys(root_key(None), placed, placed.images.marks, 0, (len(placed) - 1) // 4, 4)[middle:]:
        pool.take_over("evicted", pool.lookup(key))
    pool.free("evicted")
    (again,) = llm.generate(request, GREEDY, continuation=False)
    assert again.num_cached_tokens == middle * 4 and again.token_ids == expected


def test_gemma4_refuses_an_image_no_step_can_hold_whole(gemma4):
    path, prompt, _ = gemma4
    llm = LLM(str(path), max_num_seqs=4, max_num_batched_tokens=14)
    refused = r"^images: 1 image, one with 12 placeholders that attend each other both ways, need a step of 13 tokens"
    with pytest.raises(ValueError, match=refused + r" .* more than the 11 that max_num_batched_tokens"):
        llm.generate(ImagePrompt(prompt(1), [picture(1)]), GREEDY)
    assert llm.stats().running == llm.stats().waiting == 0 and llm.stats().kv.pages_used == 0


def test_a_steps_new_images_are_encoded_together_where_their_shapes_allow(family, monkeypatch):
    """Images a step reaches are encoded in one pass of the tower per shape (Qwen's patches of any
    count join; Gemma 4's and Pixtral's pictures join when their sizes match) and within the step
    reserve, each as it would be alone."""
    path, _, _ = family
    vision, alone = LLM(str(path)).engine.vision, LLM(str(path)).engine.vision
    images = [vision.process(picture(i, size)) for i, size in ((1, (48, 64)), (2, (48, 64)), (3, (64, 48)))]
    passes = []
    for v in (vision, alone):
        encode = v.model.get_input_embeddings
        counted = lambda ids, *a, encode=encode, **k: passes.append(ids.size) or encode(ids, *a, **k)  # noqa: E731
        monkeypatch.setattr(v.model, "get_input_embeddings", counted)
    together = vision.features(images + images[:1])
    assert together[3] is together[0]  # the same image, once
    a, b, c = (len(image.ids) for image in images)
    assert passes == ([a + b + c] if "qwen" in path.name else [a + b, c])
    passes.clear()
    singles = alone.features(images, budget=max(map(alone.encode_bytes, images)))  # a reserve for one image
    assert passes == [a, b, c]
    for features, single in zip(together, singles):
        assert np.abs(np.array(features.rows) - np.array(single.rows)).max() < 1e-4
        assert len(features.deepstack) == len(single.deepstack)
        for x, y in zip(features.deepstack, single.deepstack):
            assert np.abs(np.array(x) - np.array(y)).max() < 1e-4
