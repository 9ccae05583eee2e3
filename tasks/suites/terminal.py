"""Terminal tasks: create, find, fix or transform files in a workspace.

Each task is an initial workspace (``files``: relative path -> content), an
instruction, and ``checks``: Python ``test_*`` functions that inspect
``/workspace`` after the model's commands ran. The model answers with a
POSIX sh script (in a ```sh block) that the ``terminal`` verifier runs with
``/bin/sh -e`` in the workspace, inside the sandbox, where only ``/usr``
is visible: coreutils, sed, grep, find, tar, gzip and python3 (stdlib).
``awk`` is left out: on Debian ``/usr/bin/awk`` is a link into
``/etc/alternatives``, which the sandbox does not mount.
The reward is the fraction of checks passed.

Every check asserts something that the untouched workspace does not
satisfy, so ``wrong`` (a script that only lists the directory) scores 0.
The split is fixed by a hash of the id (about 20 % held out).
"""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.contracts import Task, VerifierSpec
from tasks.suites import split_of, suite_task

SUITE = "terminal"

_PRELUDE = '''\
import os

W = "/workspace"


def read(path):
    with open(os.path.join(W, path)) as f:
        return f.read()


def files(top):
    """Relative paths of the regular files under top."""
    base = os.path.join(W, top)
    return sorted(os.path.relpath(os.path.join(d, n), base) for d, _, ns in os.walk(base) for n in ns)

'''


@dataclass(frozen=True)
class Problem:
    id: str
    difficulty: int  # 1 (easy) .. 3 (hard)
    instruction: str
    files: dict[str, str]
    solution: str  # a POSIX sh script
    checks: str  # test_* functions; the prelude's read() and files() are available
    wrong_script: str = "ls\n"

    @property
    def split(self) -> str:
        return split_of(SUITE, self.id)

    @property
    def reference(self) -> str:
        return f"```sh\n{self.solution}```\n"

    @property
    def wrong(self) -> str:
        return f"```sh\n{self.wrong_script}```\n"

    @property
    def check_source(self) -> str:
        return _PRELUDE + self.checks

    @property
    def prompt(self) -> str:
        listing = "\n".join(f"  {p}" for p in sorted(self.files)) or "  (empty)"
        return (
            "You are in a shell in the directory /workspace, which contains these files:\n"
            f"{listing}\n\n"
            f"Task: {self.instruction}\n\n"
            "Reply with a POSIX sh script in a ```sh code block. It runs with `sh -e` in /workspace, "
            "without network; available tools: coreutils, sed, grep, find, tar, gzip and python3 (standard library only).\n"
        )


_PROBLEMS = [
    Problem(
        "rename_txt_to_md",
        1,
        "Rename every .txt file in notes/ to the same name with the extension .md.",
        {"notes/a.txt": "alpha\n", "notes/b.txt": "beta\n", "notes/keep.csv": "x,y\n"},
        'for f in notes/*.txt; do mv "$f" "${f%.txt}.md"; done\n',
        "def test_md_files_keep_their_content():\n    assert read('notes/a.md') == 'alpha\\n' and read('notes/b.md') == 'beta\\n'\n\n"
        "def test_no_txt_left():\n    assert files('notes') == ['a.md', 'b.md', 'keep.csv']\n",
    ),
    Problem(
        "count_lines",
        1,
        "Write the number of lines in data/log.txt to count.txt (just the number).",
        {"data/log.txt": "".join(f"event {i}\n" for i in range(7))},
        "wc -l < data/log.txt > count.txt\n",
        "def test_count():\n    assert read('count.txt').strip() == '7'\n",
    ),
    Problem(
        "fix_config_typo",
        1,
        "In config/app.ini the key `prot` is a typo for `port`. Fix it without changing anything else.",
        {"config/app.ini": "[server]\nhost = 0.0.0.0\nprot = 8080\ndebug = false\n"},
        "sed -i 's/^prot =/port =/' config/app.ini\n",
        "def test_port_key():\n    assert 'port = 8080' in read('config/app.ini').splitlines()\n\n"
        "def test_rest_unchanged():\n    assert read('config/app.ini') == '[server]\\nhost = 0.0.0.0\\nport = 8080\\ndebug = false\\n'\n",
    ),
    Problem(
        "sort_csv_by_age",
        2,
        "Write people.csv sorted by the age column (numerically, ascending) to sorted.csv, with the header line first.",
        {"people.csv": "name,age,city\nalice,34,paris\nbob,27,berlin\ncarol,45,rome\ndave,9,oslo\n"},
        "head -n 1 people.csv > sorted.csv\ntail -n +2 people.csv | sort -t, -k2,2n >> sorted.csv\n",
        "def test_header_first():\n    assert read('sorted.csv').splitlines()[0] == 'name,age,city'\n\n"
        "def test_rows_sorted_by_age():\n    assert read('sorted.csv').splitlines()[1:] == "
        "['dave,9,oslo', 'bob,27,berlin', 'alice,34,paris', 'carol,45,rome']\n",
    ),
    Problem(
        "delete_empty_files",
        1,
        "Delete every empty file under data/, in subdirectories too; keep the other files.",
        {"data/a.txt": "x\n", "data/empty1.txt": "", "data/sub/empty2.log": "", "data/sub/b.log": "y\n"},
        "find data -type f -empty -delete\n",
        "def test_empty_files_gone():\n"
        "    assert not any(os.path.exists(f'{W}/data/{f}') for f in ('empty1.txt', 'sub/empty2.log'))\n\n"
        "def test_only_non_empty_files_remain():\n    assert files('data') == ['a.txt', 'sub/b.log']\n",
    ),
    Problem(
        "make_dir_tree",
        1,
        "Create the directories project/src, project/tests and project/docs, and a file project/docs/README.md "
        "whose content is the single line `# Project`.",
        {},
        "mkdir -p project/src project/tests project/docs\necho '# Project' > project/docs/README.md\n",
        "def test_directories():\n    assert all(os.path.isdir(f'{W}/project/{d}') for d in ('src', 'tests', 'docs'))\n\n"
        "def test_readme():\n    assert read('project/docs/README.md') == '# Project\\n'\n",
    ),
    Problem(
        "extract_email_column",
        1,
        "Write the email column of users.csv, without the header, to emails.txt, one address per line.",
        {"users.csv": "id,name,email\n1,Ann,ann@example.com\n2,Bo,bo@example.org\n3,Cy,cy@example.net\n"},
        "tail -n +2 users.csv | cut -d, -f3 > emails.txt\n",
        "def test_emails():\n    assert read('emails.txt').splitlines() == ['ann@example.com', 'bo@example.org', 'cy@example.net']\n",
    ),
    Problem(
        "https_everywhere",
        2,
        "Replace every `http://` with `https://` in the .html files under site/.",
        {
            "site/index.html": '<a href="http://example.com">home</a>\n<img src="http://cdn.example.com/x.png">\n',
            "site/about.html": '<a href="http://example.com/about">about</a>\n',
        },
        "sed -i 's#http://#https://#g' site/*.html\n",
        "def test_no_http_left():\n    assert not any('http://' in read('site/' + f) for f in files('site'))\n\n"
        "def test_links_upgraded():\n    assert read('site/index.html') == "
        '\'<a href="https://example.com">home</a>\\n<img src="https://cdn.example.com/x.png">\\n\'\n',
    ),
    Problem(
        "concat_chapters",
        1,
        "Concatenate the files in chapters/, in the order of their names, into book.txt.",
        {
            "chapters/01-intro.txt": "Once upon a time\n",
            "chapters/02-middle.txt": "things happened\n",
            "chapters/03-end.txt": "The end\n",
        },
        "cat chapters/*.txt > book.txt\n",
        "def test_book():\n    assert read('book.txt') == 'Once upon a time\\nthings happened\\nThe end\\n'\n",
    ),
    Problem(
        "uppercase_in_place",
        1,
        "Convert the contents of shout.txt to upper case, in place (leave no other files behind).",
        {"shout.txt": "hello there\nquiet please\n"},
        "tr a-z A-Z < shout.txt > shout.tmp\nmv shout.tmp shout.txt\n",
        "def test_upper_case():\n    assert read('shout.txt') == 'HELLO THERE\\nQUIET PLEASE\\n'\n\n"
        "def test_no_leftovers():\n    assert files('.') == ['shout.txt'] and read('shout.txt').isupper()\n",
    ),
    Problem(
        "unique_sorted_names",
        1,
        "Write the distinct lines of names.txt, sorted alphabetically, to unique.txt.",
        {"names.txt": "bob\nalice\nbob\ncarol\nalice\n"},
        "sort -u names.txt > unique.txt\n",
        "def test_unique():\n    assert read('unique.txt').splitlines() == ['alice', 'bob', 'carol']\n",
    ),
    Problem(
        "grep_errors",
        1,
        "Copy the lines of app.log that contain `ERROR` into errors.log, keeping their order.",
        {"app.log": "10:00 INFO start\n10:01 ERROR disk full\n10:02 WARN slow\n10:03 ERROR timeout\n10:04 INFO stop\n"},
        "grep ERROR app.log > errors.log\n",
        "def test_errors():\n    assert read('errors.log') == '10:01 ERROR disk full\\n10:03 ERROR timeout\\n'\n",
    ),
    Problem(
        "count_python_files",
        2,
        "Write the number of .py files under src/ (recursively) to py_count.txt (just the number).",
        {"src/a.py": "", "src/pkg/b.py": "", "src/pkg/c.txt": "", "src/pkg/sub/d.py": "", "e.py": ""},
        "find src -type f -name '*.py' | wc -l > py_count.txt\n",
        "def test_count():\n    assert read('py_count.txt').strip() == '3'\n",
    ),
    Problem(
        "move_logs",
        1,
        "Move every .log file of the top directory into a new directory logs/.",
        {"a.log": "first\n", "b.log": "second\n", "notes.txt": "keep me\n"},
        "mkdir -p logs\nmv *.log logs/\n",
        "def test_logs_moved():\n    assert files('logs') == ['a.log', 'b.log'] and read('logs/b.log') == 'second\\n'\n\n"
        "def test_top_level():\n    assert sorted(os.listdir(W)) == ['logs', 'notes.txt']\n",
    ),
    Problem(
        "sum_column",
        2,
        "Write the sum of the qty column of sales.csv to total.txt (just the number).",
        {"sales.csv": "item,qty,price\napple,3,0.5\npear,10,0.25\nplum,7,1.0\n"},
        'total=0\nfor q in $(tail -n +2 sales.csv | cut -d, -f2); do total=$((total + q)); done\necho "$total" > total.txt\n',
        "def test_total():\n    assert read('total.txt').strip() == '20'\n",
    ),
    Problem(
        "json_set_debug",
        2,
        'In settings.json set "debug" to false; keep the other keys and their values.',
        {"settings.json": '{"name": "demo", "debug": true, "workers": 4}\n'},
        "python3 - <<'EOF'\nimport json\nwith open('settings.json') as f:\n    d = json.load(f)\nd['debug'] = False\n"
        "with open('settings.json', 'w') as f:\n    json.dump(d, f)\nEOF\n",
        "import json\n\n\ndef test_settings():\n"
        "    assert json.loads(read('settings.json')) == {'name': 'demo', 'debug': False, 'workers': 4}\n",
    ),
    Problem(
        "symlink_current",
        2,
        "Create a symbolic link named `current`, relative, pointing to releases/v2.",
        {"releases/v1/app.txt": "v1\n", "releases/v2/app.txt": "v2\n"},
        "ln -s releases/v2 current\n",
        "def test_is_relative_link():\n"
        "    assert os.path.islink(W + '/current') and os.readlink(W + '/current').rstrip('/') == 'releases/v2'\n\n"
        "def test_resolves():\n    assert read('current/app.txt') == 'v2\\n'\n",
    ),
    Problem(
        "strip_trailing_whitespace",
        2,
        "Remove the trailing spaces and tabs from every line of code.py.",
        {"code.py": "def f(x):  \n    return x\t\n\nprint(f(1))   \n"},
        "sed -i 's/[[:space:]]*$//' code.py\n",
        "def test_stripped():\n    assert read('code.py') == 'def f(x):\\n    return x\\n\\nprint(f(1))\\n'\n",
    ),
    Problem(
        "make_executable",
        1,
        "Make run.sh executable.",
        {"run.sh": "#!/bin/sh\necho hi\n"},
        "chmod +x run.sh\n",
        "def test_executable():\n    assert os.access(W + '/run.sh', os.X_OK)\n",
    ),
    Problem(
        "spaces_to_underscores",
        2,
        "In photos/, rename the files whose names contain spaces: replace every space in the name with an underscore.",
        {"photos/my cat.jpg": "1", "photos/beach day 2.jpg": "2", "photos/plain.jpg": "3"},
        "for f in photos/*' '*; do mv \"$f\" \"photos/$(basename \"$f\" | tr ' ' '_')\"; done\n",
        "def test_renamed():\n    assert files('photos') == ['beach_day_2.jpg', 'my_cat.jpg', 'plain.jpg']\n\n"
        "def test_content_kept():\n    assert read('photos/beach_day_2.jpg') == '2'\n",
    ),
    Problem(
        "excerpt_lines",
        1,
        "Write lines 3 to 5 of poem.txt to excerpt.txt.",
        {"poem.txt": "".join(f"line {i}\n" for i in range(1, 9))},
        "sed -n '3,5p' poem.txt > excerpt.txt\n",
        "def test_excerpt():\n    assert read('excerpt.txt') == 'line 3\\nline 4\\nline 5\\n'\n",
    ),
    Problem(
        "dedupe_keep_order",
        2,
        "Write list.txt without repeated lines to deduped.txt, keeping the first occurrence of each line, in the original order.",
        {"list.txt": "pear\napple\npear\nfig\napple\nkiwi\n"},
        ": > deduped.txt\nwhile IFS= read -r line; do\n"
        '    grep -qxF -- "$line" deduped.txt || printf \'%s\\n\' "$line" >> deduped.txt\ndone < list.txt\n',
        "def test_deduped():\n    assert read('deduped.txt').splitlines() == ['pear', 'apple', 'fig', 'kiwi']\n",
    ),
    Problem(
        "largest_file",
        2,
        "Write the name (without the directory) of the largest file in data/ to largest.txt.",
        {"data/small.bin": "s" * 10, "data/big.bin": "b" * 300, "data/mid.bin": "m" * 100},
        "ls -S data | head -n 1 > largest.txt\n",
        "def test_largest():\n    assert read('largest.txt').strip() == 'big.bin'\n",
    ),
    Problem(
        "env_value",
        1,
        "Write the value of DB_HOST from the file .env to host.txt.",
        {".env": "DB_USER=app\nDB_HOST=db.internal\nDB_PORT=5432\n"},
        "grep '^DB_HOST=' .env | cut -d= -f2 > host.txt\n",
        "def test_host():\n    assert read('host.txt').strip() == 'db.internal'\n",
    ),
    Problem(
        "tsv_to_csv",
        1,
        "Convert data.tsv (tab-separated) to data.csv (comma-separated); keep data.tsv.",
        {"data.tsv": "a\tb\tc\n1\t2\t3\n"},
        "tr '\\t' ',' < data.tsv > data.csv\n",
        "def test_csv():\n    assert read('data.csv') == 'a,b,c\\n1,2,3\\n' and os.path.exists(W + '/data.tsv')\n",
    ),
    Problem(
        "archive_logs",
        3,
        "Create a gzip-compressed tar archive logs.tar.gz that contains the directory logs/ (paths starting with logs/), "
        "then delete the directory logs/.",
        {"logs/a.log": "aaa\n", "logs/b.log": "bbb\n"},
        "tar -czf logs.tar.gz logs\nrm -r logs\n",
        "import tarfile\n\n\ndef test_archive():\n    with tarfile.open(W + '/logs.tar.gz', 'r:gz') as t:\n"
        "        assert t.extractfile('logs/b.log').read() == b'bbb\\n' and 'logs/a.log' in t.getnames()\n\n"
        "def test_directory_removed():\n    assert not os.path.exists(W + '/logs') and os.path.exists(W + '/logs.tar.gz')\n",
    ),
    Problem(
        "orders_per_city",
        3,
        "orders.csv has a header and the columns id,city,amount. Write one line `city,count` per city (the number of its "
        "orders) to by_city.csv, sorted by city, without a header.",
        {"orders.csv": "id,city,amount\n1,paris,10\n2,oslo,5\n3,paris,7\n4,lima,3\n5,oslo,8\n6,paris,1\n"},
        "tail -n +2 orders.csv | cut -d, -f2 | sort | uniq -c | sed 's/^ *\\([0-9]*\\) \\(.*\\)$/\\2,\\1/' > by_city.csv\n",
        "def test_counts():\n    assert read('by_city.csv').splitlines() == ['lima,1', 'oslo,2', 'paris,3']\n",
    ),
    Problem(
        "backup_configs",
        3,
        "Copy every .conf file under conf/ into backup/, keeping the directory structure below conf/, and append "
        "`.bak` to the name of each copy (conf/x/y.conf becomes backup/x/y.conf.bak). Leave conf/ as it is.",
        {"conf/a.conf": "a=1\n", "conf/b.conf": "b=2\n", "conf/sub/c.conf": "c=3\n", "conf/readme.txt": "docs\n"},
        "find conf -type f -name '*.conf' | while read -r f; do\n    d=\"backup/${f#conf/}.bak\"\n"
        '    mkdir -p "$(dirname "$d")"\n    cp "$f" "$d"\ndone\n',
        "def test_backups():\n    assert files('backup') == ['a.conf.bak', 'b.conf.bak', 'sub/c.conf.bak']\n\n"
        "def test_backup_content_and_originals():\n"
        "    assert read('backup/sub/c.conf.bak') == 'c=3\\n' and read('conf/sub/c.conf') == 'c=3\\n'\n",
    ),
]


def problems() -> list[Problem]:
    return list(_PROBLEMS)


def to_task(p: Problem, run_id: str, group_size: int, index: int) -> Task:
    data = {"suite": SUITE, "files": dict(p.files), "checks": p.check_source, "style": "functions", "reward": "fraction"}
    return suite_task(SUITE, p, run_id, group_size, index, prompt=p.prompt, max_tokens=512,
                      verifier=VerifierSpec(kind="terminal", data=data))  # fmt: skip
