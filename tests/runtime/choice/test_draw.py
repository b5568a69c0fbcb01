"""llama-perplexity's task draws replicated: the generator against its published first outputs, and both draws
against the C++ standard library itself, the code llama-perplexity runs, compiled here (skipped without g++)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from mfgguf.runtime.choice.draw import MT19937, float_draw_order, hellaswag_order

CPP = r"""
#include <cstdio>
#include <random>
#include <vector>
int main(int argc, char ** argv) {
    const size_t n_tasks = std::stoul(argv[1]), n = std::stoul(argv[2]);
    {   // hellaswag_score: a uniform_int_distribution over the tasks left, the drawn one erased
        std::mt19937 rng(1);
        std::vector<size_t> left;
        for (size_t i = 0; i < n_tasks; ++i) left.push_back(i);
        for (size_t i = 0; i < n; ++i) {
            std::uniform_int_distribution<size_t> dist(0, left.size() - 1);
            size_t idx = dist(rng);
            printf("%zu ", left[idx]);
            left.erase(left.begin() + idx);
        }
        printf("\n");
    }
    {   // winogrande_score and multiple_choice_score: the float draw over aux
        std::mt19937 rng(1);
        std::vector<int> aux;
        for (size_t i = 0; i < n_tasks; ++i) aux.push_back(i);
        float scale = 1/(1.f + (float)rng.max());
        for (size_t i = 0; i < n; ++i) {
            int j = int(scale*rng()*aux.size());
            printf("%d ", aux[j]);
            aux[j] = aux.back();
            aux.pop_back();
        }
        printf("\n");
    }
}
"""


def test_the_generator_gives_std_mt19937s_first_outputs():
    rng = MT19937(1)
    assert [rng() for _ in range(3)] == [1791095845, 4282876139, 3093770124]
    rng = MT19937(5489)  # the standard's default seed: its 10000th output is fixed by the C++ standard
    assert [rng() for _ in range(10000)][-1] == 4123659995


@pytest.mark.parametrize("n_tasks,n", [(12, 12), (12, 5), (10042, 400), (37, 36)])
def test_both_draws_are_the_c_plus_plus_librarys(tmp_path, n_tasks, n):
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("no g++ to build the C++ draw against")
    (tmp_path / "draw.cpp").write_text(CPP)
    subprocess.run([gxx, "-O1", "-std=c++17", "-o", str(tmp_path / "draw"), str(tmp_path / "draw.cpp")], check=True)
    out = subprocess.run([str(tmp_path / "draw"), str(n_tasks), str(n)], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert [int(x) for x in out[0].split()] == hellaswag_order(n_tasks, n)
    if n < n_tasks:  # llama-perplexity draws these only for fewer tasks than the file holds
        assert [int(x) for x in out[1].split()] == float_draw_order(n_tasks, n)


def test_every_task_asked_for_keeps_the_files_order_in_the_float_draw_and_shuffles_hellaswag():
    assert float_draw_order(6, 6) == list(range(6)) == float_draw_order(6, 0)
    assert sorted(hellaswag_order(6, 6)) == list(range(6)) != hellaswag_order(6, 6)
