"""tfimage convert-script on the shapes of batch script sites have: each converted line
checked exactly, everything else kept byte for byte, and each construct that cannot be
converted left as is, saying why."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tfimage.agent.submit.script import MARK, convert

VENV_BIN = Path(sys.executable).parent
GUIDE = """\
#!/bin/bash
#SBATCH --job-name=tensorflow_train
#SBATCH --output=logs/train_%j.out
#SBATCH --partition=gpu
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --gres=gpu:4
#SBATCH --cpus-per-task=8
#SBATCH --mem=64G
#SBATCH --time=24:00:00
module load singularity/3.8
singularity exec \\
  --nv \\
  --bind /data:/mnt \\
  docker://tensorflow/tensorflow:latest-gpu-jupyter \\
  python /mnt/train_model.py
"""


def test_the_guides_script_becomes_an_ordinary_tfimage_job() -> None:
    got = convert(GUIDE)
    assert got.problems == [] and got.changed == 1
    head = GUIDE.split("module load")[0]
    assert got.text == head + (
        "#SBATCH --tf-image=docker://tensorflow/tensorflow:latest-gpu-jupyter\n"
        "#SBATCH --tf-mount=/data:/mnt\n"
        "#SBATCH --tf-batch=container\n"
        "# module load singularity/3.8  # tfimage: not needed with --tf-image\n"
        "python /mnt/train_model.py\n"
    )


def _script(body: str, header: str = "#SBATCH -n 1\n") -> str:
    return f"#!/bin/sh\n{header}set -e\necho start  # a comment\n{body}echo end\n"


def _converted_line(text: str) -> list[str]:
    """The lines that are not the _script skeleton's nor the #SBATCH header's."""
    skeleton = {"#!/bin/sh", "set -e", "echo start  # a comment", "echo end"}
    return [x for x in text.splitlines() if x not in skeleton and not x.startswith("#SBATCH")]


@pytest.mark.parametrize(
    ("body", "header", "image", "mounts", "line"),
    [
        # apptainer, several binds in one flag and in several, ro kept, dst defaulted
        ("apptainer exec -B /data:/mnt,/scratch/u -B /home/u/ds:/ds:ro docker://img:1 "
         "python t.py\n",
         "", "docker://img:1", "/data:/mnt,/scratch/u:/scratch/u,/home/u/ds:/ds:ro", "python t.py"),
        # --bind=, --env with two values, the command's own quoting and variables kept
        ("singularity exec --bind=/data:/d --env A=1,B='x y' docker://py:3 "
         "python -c 'print(1)' \"$X\"\n",
         "", "docker://py:3", "/data:/d", "env A=1 'B=x y' python -c 'print(1)' \"$X\""),
        # --pwd, and srun in front (kept: the step inherits the job's image)
        ("srun -n 4 singularity exec --nv --pwd /work oras://reg.site/ml/tf:2 python train.py\n",
         "#SBATCH --ntasks=4\n", "oras://reg.site/ml/tf:2", None,
         "srun -n 4 sh -c 'cd /work && exec \"$0\" \"$@\"' python train.py"),
        # a bare exec in a job of 8 tasks: still once, in the image (--tf-batch=container)
        ("singularity exec docker://tf.example.org/ml/tf:2 python prep.py\n", "#SBATCH -n 8\n",
         "docker://tf.example.org/ml/tf:2", None, "python prep.py"),
        # apptainer run with a command is an exec of it; a full path to the runtime
        ("/usr/bin/apptainer run --nv docker://nvcr.io/nvidia/tensorflow:24.01-tf2-py3 "
         "python x.py\n",
         "", "docker://nvcr.io/nvidia/tensorflow:24.01-tf2-py3", None, "python x.py"),
        # time in front, and a pipeline after: both kept as written
        ("time singularity exec oras://img:2 python t.py | tee log.txt\n", "", "oras://img:2",
         None, "time python t.py | tee log.txt"),
    ],
)  # fmt: skip
def test_real_world_exec_lines_convert(
    body: str, header: str, image: str, mounts: str | None, line: str
) -> None:
    got = convert(_script(body, header))
    assert got.problems == [] and got.changed == 1, got.problems
    assert f"#SBATCH --tf-image={image}\n" in got.text
    assert (f"#SBATCH --tf-mount={mounts}\n" in got.text) == bool(mounts)
    assert _converted_line(got.text) == [line]
    # everything else, in order, byte for byte
    assert [x for x in got.text.splitlines(keepends=True) if x.endswith(("sh\n", "-e\n",
            "comment\n", "end\n"))] == ["#!/bin/sh\n", "set -e\n", "echo start  # a comment\n",
                                       "echo end\n"]  # fmt: skip


def test_cleanenv_goes_with_a_comment_saying_what_the_task_keeps() -> None:
    got = convert(_script("singularity exec --cleanenv docker://img:1 python t.py\n"))
    assert got.problems == []
    assert _converted_line(got.text) == [
        f"{MARK} --cleanenv dropped: a task keeps the job's environment",
        "python t.py",
    ]


def test_the_same_image_twice_is_one_tf_image_and_both_lines_convert() -> None:
    twice = "singularity exec docker://i:1 python a.py\nsingularity exec docker://i:1 python b.py\n"
    got = convert(_script(twice))
    assert got.changed == 2 and got.text.count("#SBATCH --tf-image=docker://i:1\n") == 1
    assert _converted_line(got.text) == ["python a.py", "python b.py"]


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ("singularity exec docker://a:1 python a.py\nsingularity exec docker://b:1 python b.py\n",
         "several images in one script (docker://a:1, docker://b:1)"),
        ("singularity exec docker://a:1 python a.py\n"
         "srun singularity exec docker://a:1 python b.py\n",
         "bare and srun exec lines in one script"),
        ('singularity exec "$IMG" python a.py\n', "the image is a shell variable"),
        ("singularity exec ${IMG} python a.py\n", "the image is a shell variable"),
        ("for s in 1 2; do\n  singularity exec docker://i:1 python a.py $s\ndone\n",
         "an exec inside a loop"),
        ("while read s; do\n  echo done\n  singularity exec docker://i:1 python a.py $s\ndone\n",
         "an exec inside a loop"),
        ("singularity exec /data/images/tf.sif python a.py\n",
         "/data/images/tf.sif is a local image: push it (tfimage push /data/images/tf.sif"),
        ("singularity exec ubuntu_latest python a.py\n", "ubuntu_latest is a local image"),
        ('singularity exec --env "PATH=/x:$PATH" docker://i:1 python a.py\n',
         "--env \"PATH=/x:$PATH\" uses the shell"),
        ("singularity exec -B ~/d:/m docker://i:1 python a.py\n", "-B ~/d:/m uses the shell"),
        ("singularity exec --pwd $PWD docker://i:1 python a.py\n", "--pwd $PWD uses the shell"),
        ("singularity exec -B data:/data docker://i:1 python a.py\n", "is not absolute"),
        ("mpirun -np 4 singularity exec docker://i:1 python a.py\n", "mpirun in front"),
        ('x="$(singularity exec docker://i:1 cat /v)"\n', "an exec it cannot read here"),
        ("singularity exec docker://i:1 true && singularity exec docker://i:1 false\n",
         "a second exec on the line"),
        ("apptainer run docker://tensorflow/tensorflow:2.16.1\n",
         "run without a command runs the image's runscript"),
        ("singularity exec --writable-tmpfs docker://i:1 python a.py\n",
         "--writable-tmpfs has no tfimage equivalent"),
        ("singularity exec -B /a:/m -B /b:/m docker://i:1 python a.py\n", "two binds onto /m"),
        ("singularity exec library://alpine:3 sh\n", "library:// images are not served"),
    ],
)  # fmt: skip
def test_what_cannot_be_converted_is_left_as_is_saying_why(body: str, why: str) -> None:
    before = _script(body)
    got = convert(before)
    assert got.changed == 0 and len(got.problems) >= 1
    assert any(why in p for p in got.problems), got.problems
    assert "#SBATCH --tf-image" not in got.text
    # Only comments were added: without them, the script is what it was.
    kept = [x for x in got.text.splitlines(keepends=True) if not x.startswith(MARK)]
    assert "".join(kept) == before
    assert f"{MARK} left as is: " in got.text


def test_a_script_without_sbatch_lines_gets_the_header_after_its_shebang() -> None:
    got = convert("#!/bin/bash\nsingularity exec docker://i:1 true")  # no final newline either
    assert got.text == (
        "#!/bin/bash\n#SBATCH --tf-image=docker://i:1\n#SBATCH --tf-batch=container\ntrue\n"
    )


def test_the_header_goes_where_sbatch_still_reads_it() -> None:
    # sbatch stops at the first command: an #SBATCH line after it is a comment.
    text = (
        "#!/bin/sh\n#SBATCH -n 1\n\n# data\necho hi\n#SBATCH -t 5\n"
        "singularity exec docker://i:1 x\n"
    )
    got = convert(text)
    assert got.text.startswith("#!/bin/sh\n#SBATCH -n 1\n#SBATCH --tf-image=docker://i:1\n")


def test_srun_lines_keep_the_batch_script_on_the_host() -> None:
    got = convert(_script("srun -n 2 singularity exec docker://i:1 python a.py\n"))
    assert "#SBATCH --tf-batch=host\n" in got.text and _converted_line(got.text) == [
        "srun -n 2 python a.py"
    ]


@given(
    st.lists(
        st.text(
            alphabet=st.characters(blacklist_characters="\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"),
            max_size=60,
        ),
        max_size=20,
    )
)
def test_a_script_without_an_exec_comes_back_byte_for_byte(lines: list[str]) -> None:
    text = "\n".join(x.replace("singularity", "s").replace("apptainer", "a") for x in lines)
    got = convert(text)
    assert (got.text, got.changed, got.problems) == (text, 0, [])


# --- the command ----------------------------------------------------------------------------------


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(VENV_BIN / "tfimage"), "convert-script", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=60)  # fmt: skip


def test_write_keeps_the_original_and_diff_shows_the_change(tmp_path: Path) -> None:
    job = tmp_path / "job.sh"
    job.write_text(GUIDE)
    job.chmod(0o750)
    r = _cli("--diff", "job.sh", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.startswith("--- a/job.sh\n+++ b/job.sh\n"), r.stderr
    assert "+#SBATCH --tf-mount=/data:/mnt\n" in r.stdout and "-  --nv \\\n" in r.stdout
    r = _cli("--write", "job.sh", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stderr == (
        "tfimage: convert-script: job.sh: 1 line(s) converted; the original is "
        f"{tmp_path}/job.sh.bak\n"
    )
    assert (tmp_path / "job.sh.bak").read_text() == GUIDE
    assert job.read_text() == convert(GUIDE).text and job.stat().st_mode & 0o777 == 0o750
    r = _cli("--write", "job.sh", cwd=tmp_path)  # nothing left to do: no second backup
    assert r.returncode == 0 and not (tmp_path / "job.sh.bak.1").exists(), r.stderr


def test_a_script_it_cannot_convert_exits_1_naming_the_line(tmp_path: Path) -> None:
    (tmp_path / "job.sh").write_text('#!/bin/sh\nsingularity exec "$IMG" python a.py\n')
    r = _cli("job.sh", cwd=tmp_path)
    assert r.returncode == 1
    assert r.stderr == ("tfimage: convert-script: job.sh: line 2: the image is a shell "
                        "variable: name it in --tf-image yourself\n")  # fmt: skip
    assert r.stdout.startswith("#!/bin/sh\n# tfimage convert-script: left as is: ")


@pytest.mark.parametrize(
    ("content", "said"),
    [(None, "No such file or directory"), (b"\xff\xfe", "not UTF-8 text"),
     (b"#" * ((1 << 20) + 1), "larger than 1048576 bytes")],
)  # fmt: skip
def test_a_bad_file_is_one_line(tmp_path: Path, content: bytes | None, said: str) -> None:
    if content is not None:
        (tmp_path / "job.sh").write_bytes(content)
    r = _cli("job.sh", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr == f"tfimage: convert-script: job.sh: {said}\n"


def test_the_user_guides_before_and_after_are_what_the_command_does() -> None:
    readme = (Path(__file__).resolve().parents[3] / "docs" / "user.md").read_text()
    section = readme.split("## Coming from `singularity exec`")[1]
    before, after = (block.split("```")[0] for block in section.split("```bash\n")[1:3])
    assert before == GUIDE
    assert convert(before).text == after
