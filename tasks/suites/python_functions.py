"""Small Python functions of graded difficulty, checked by unit tests.

Each problem is a signature with a docstring; the model writes the function
(or class) in a ```python block and the ``python_tests`` verifier runs it
against a few ``test_*`` functions in the sandbox (``style: functions``,
``reward: fraction``: the reward is the fraction of tests passed).

The table below is the whole suite: a signature, a docstring, a reference
body and test cases as ``(call, expected)`` pairs of Python expressions;
each case becomes one ``test_*`` function whose failure message shows the
call, what it returned and what was expected. Class problems add helper
code to the tests (``helpers``) that drives an instance through a list of
operations.

``wrong`` is a well-formed but wrong answer (the signature returning
``None``): it must score 0, which also checks that no test passes by
accident. The split is fixed by a hash of the id (about 20 % held out).
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass

from conveyor.contracts import Task, VerifierSpec
from tasks.suites import split_of, suite_task

SUITE = "python_functions"


def _indent(src: str) -> str:
    return textwrap.indent(textwrap.dedent(src).strip("\n"), "    ")


@dataclass(frozen=True)
class Problem:
    id: str
    difficulty: int  # 1 (easy) .. 3 (hard)
    signature: str  # "def f(x: int) -> int:" or "class C:"
    doc: str
    body: str  # the reference implementation's body
    cases: tuple[tuple[str, str], ...]  # (call, expected) Python expressions
    helpers: str = ""  # extra (non-test) code for the tests
    wrong_body: str = "return None"

    @property
    def name(self) -> str:
        return self.signature.split()[1].split("(")[0].rstrip(":")

    @property
    def split(self) -> str:
        return split_of(SUITE, self.id)

    @property
    def stub(self) -> str:
        return f"{self.signature}\n{_indent(chr(34) * 3 + textwrap.dedent(self.doc).strip() + chr(34) * 3)}\n"

    @property
    def reference(self) -> str:
        return f"```python\n{self.signature}\n{_indent(self.body)}\n```\n"

    @property
    def wrong(self) -> str:
        return f"```python\n{self.signature}\n{_indent(self.wrong_body)}\n```\n"

    @property
    def prompt(self) -> str:
        kind = "class" if self.signature.startswith("class") else "function"
        return (
            f"Implement the following Python {kind}. Use only the standard library.\n\n"
            f"```python\n{self.stub}```\n\n"
            f"Reply with the complete {kind} in a ```python code block.\n"
        )

    @property
    def tests(self) -> str:
        parts = [textwrap.dedent(self.helpers).strip() + "\n"] if self.helpers else []
        for n, (call, want) in enumerate(self.cases, 1):
            parts.append(
                f"def test_{self.name.lower()}_{n}():\n"
                f"    got, want = {call}, {want}\n"
                f"    assert got == want, '%s returned %r, expected %r' % ({call!r}, got, want)\n"
            )
        return "\n\n".join(parts)


def P(id: str, difficulty: int, signature: str, doc: str, body: str, *cases: tuple[str, str], **kw: str) -> Problem:
    return Problem(id, difficulty, signature, doc, body, tuple(cases), **kw)


_STACK_HELPERS = """
def _run(cls, ops, *args):
    obj, out = cls(*args), []
    for name, *a in ops:
        out.append(getattr(obj, name)(*a))
    return out
"""

_PROBLEMS = [
    # ---- difficulty 1 -------------------------------------------------------
    P(
        "reverse_string",
        1,
        "def reverse_string(s: str) -> str:",
        "Return s reversed.",
        "return s[::-1]",
        ("reverse_string('abc')", "'cba'"),
        ("reverse_string('')", "''"),
        ("reverse_string('racecar!')", "'!racecar'"),
    ),
    P(
        "is_palindrome",
        1,
        "def is_palindrome(s: str) -> bool:",
        "True when s reads the same backwards, ignoring case and every character that is not a letter or digit.",
        """
      t = [c.lower() for c in s if c.isalnum()]
      return t == t[::-1]
      """,
        ("is_palindrome('A man, a plan, a canal: Panama')", "True"),
        ("is_palindrome('hello')", "False"),
        ("is_palindrome('No lemon, no melon')", "True"),
        ("is_palindrome('ab')", "False"),
    ),
    P(
        "count_vowels",
        1,
        "def count_vowels(s: str) -> int:",
        "Number of vowels (a, e, i, o, u, either case) in s.",
        "return sum(c in 'aeiouAEIOU' for c in s)",
        ("count_vowels('hello')", "2"),
        ("count_vowels('AEIOU xyz')", "5"),
        ("count_vowels('rhythm')", "0"),
    ),
    P(
        "fizzbuzz",
        1,
        "def fizzbuzz(n: int) -> list[str]:",
        """
      The FizzBuzz sequence for 1..n as strings: 'Fizz' for multiples of 3,
      'Buzz' for multiples of 5, 'FizzBuzz' for multiples of both, else the number.
      """,
        "return ['FizzBuzz' if i % 15 == 0 else 'Fizz' if i % 3 == 0 else 'Buzz' if i % 5 == 0 else str(i) for i in range(1, n + 1)]",
        ("fizzbuzz(5)", "['1', '2', 'Fizz', '4', 'Buzz']"),
        ("fizzbuzz(15)[-1]", "'FizzBuzz'"),
        ("fizzbuzz(0)", "[]"),
        ("fizzbuzz(10)[8:]", "['Fizz', 'Buzz']"),
    ),
    P(
        "sum_of_digits",
        1,
        "def sum_of_digits(n: int) -> int:",
        "Sum of the decimal digits of n (n may be negative: use |n|).",
        "return sum(int(d) for d in str(abs(n)))",
        ("sum_of_digits(1234)", "10"),
        ("sum_of_digits(0)", "0"),
        ("sum_of_digits(-505)", "10"),
    ),
    P(
        "factorial",
        1,
        "def factorial(n: int) -> int:",
        "n! for n >= 0.",
        """
      r = 1
      for i in range(2, n + 1):
          r *= i
      return r
      """,
        ("factorial(0)", "1"),
        ("factorial(5)", "120"),
        ("factorial(10)", "3628800"),
    ),
    P(
        "celsius_to_fahrenheit",
        1,
        "def celsius_to_fahrenheit(c: float) -> float:",
        "Convert degrees Celsius to Fahrenheit.",
        "return c * 9 / 5 + 32",
        ("celsius_to_fahrenheit(0)", "32"),
        ("celsius_to_fahrenheit(100)", "212"),
        ("celsius_to_fahrenheit(-40)", "-40"),
    ),
    P(
        "count_words",
        1,
        "def count_words(s: str) -> int:",
        "Number of whitespace-separated words in s.",
        "return len(s.split())",
        ("count_words('the quick  brown fox')", "4"),
        ("count_words('   ')", "0"),
        ("count_words('one\\ntwo\\tthree')", "3"),
    ),
    P(
        "capitalize_words",
        1,
        "def capitalize_words(s: str) -> str:",
        "Upper-case the first letter of every space-separated word and lower-case the rest; keep the spaces as they are.",
        "return ' '.join(w[:1].upper() + w[1:].lower() for w in s.split(' '))",
        ("capitalize_words('hello world')", "'Hello World'"),
        ("capitalize_words('pYTHON  is FUN')", "'Python  Is Fun'"),
        ("capitalize_words('a')", "'A'"),
    ),
    P(
        "remove_duplicates",
        1,
        "def remove_duplicates(xs: list) -> list:",
        "xs without repeated elements, keeping first occurrences in order.",
        "return list(dict.fromkeys(xs))",
        ("remove_duplicates([3, 1, 3, 2, 1])", "[3, 1, 2]"),
        ("remove_duplicates([])", "[]"),
        ("remove_duplicates(['a', 'b', 'a'])", "['a', 'b']"),
    ),
    P(
        "second_largest",
        1,
        "def second_largest(xs: list[int]) -> int:",
        "The second largest distinct value in xs (xs has at least two distinct values).",
        "return sorted(set(xs))[-2]",
        ("second_largest([1, 5, 3])", "3"),
        ("second_largest([7, 7, 2])", "2"),
        ("second_largest([-1, -5, -3, -1])", "-3"),
    ),
    P(
        "is_anagram",
        1,
        "def is_anagram(a: str, b: str) -> bool:",
        "True when a and b contain the same letters (case-insensitive, spaces ignored).",
        "return sorted(a.replace(' ', '').lower()) == sorted(b.replace(' ', '').lower())",
        ("is_anagram('listen', 'silent')", "True"),
        ("is_anagram('Dormitory', 'dirty room')", "True"),
        ("is_anagram('abc', 'abd')", "False"),
    ),
    P(
        "flatten_once",
        1,
        "def flatten_once(xss: list[list]) -> list:",
        "Concatenate the lists in xss into one list.",
        "return [x for xs in xss for x in xs]",
        ("flatten_once([[1, 2], [3], []])", "[1, 2, 3]"),
        ("flatten_once([])", "[]"),
        ("flatten_once([['a'], ['b', 'c']])", "['a', 'b', 'c']"),
    ),
    P(
        "chunk",
        1,
        "def chunk(xs: list, n: int) -> list[list]:",
        "Split xs into consecutive lists of length n (the last may be shorter).",
        "return [xs[i:i + n] for i in range(0, len(xs), n)]",
        ("chunk([1, 2, 3, 4, 5], 2)", "[[1, 2], [3, 4], [5]]"),
        ("chunk([], 3)", "[]"),
        ("chunk([1, 2, 3], 3)", "[[1, 2, 3]]"),
    ),
    P(
        "clamp",
        1,
        "def clamp(x: float, lo: float, hi: float) -> float:",
        "x limited to the range [lo, hi].",
        "return max(lo, min(hi, x))",
        ("clamp(5, 0, 10)", "5"),
        ("clamp(-3, 0, 10)", "0"),
        ("clamp(42, 0, 10)", "10"),
    ),
    # ---- difficulty 2 -------------------------------------------------------
    P(
        "run_length_encode",
        2,
        "def run_length_encode(s: str) -> str:",
        "Run-length encoding: each run of a character becomes the character followed by the run's length, e.g. 'aaab' -> 'a3b1'.",
        """
      out, i = [], 0
      while i < len(s):
          j = i
          while j < len(s) and s[j] == s[i]:
              j += 1
          out.append(f"{s[i]}{j - i}")
          i = j
      return ''.join(out)
      """,
        ("run_length_encode('aaabbc')", "'a3b2c1'"),
        ("run_length_encode('')", "''"),
        ("run_length_encode('abba')", "'a1b2a1'"),
        ("run_length_encode('zzzzzzzzzzzz')", "'z12'"),
    ),
    P(
        "run_length_decode",
        2,
        "def run_length_decode(s: str) -> str:",
        "Inverse of run-length encoding: 'a3b12' -> 'aaa' followed by twelve 'b'. Characters are letters, counts are decimal.",
        """
      import re
      return ''.join(c * int(n) for c, n in re.findall(r'(\\D)(\\d+)', s))
      """,
        ("run_length_decode('a3b2c1')", "'aaabbc'"),
        ("run_length_decode('')", "''"),
        ("run_length_decode('x10')", "'x' * 10"),
    ),
    P(
        "balanced_brackets",
        2,
        "def balanced_brackets(s: str) -> bool:",
        "True when the brackets (), [] and {} in s are balanced and properly nested; other characters are ignored.",
        """
      pairs, stack = {')': '(', ']': '[', '}': '{'}, []
      for c in s:
          if c in '([{':
              stack.append(c)
          elif c in pairs:
              if not stack or stack.pop() != pairs[c]:
                  return False
      return not stack
      """,
        ("balanced_brackets('([]{})')", "True"),
        ("balanced_brackets('([)]')", "False"),
        ("balanced_brackets('((')", "False"),
        ("balanced_brackets('f(a[1]) + {x}')", "True"),
        ("balanced_brackets(')(')", "False"),
    ),
    P(
        "transpose",
        2,
        "def transpose(m: list[list]) -> list[list]:",
        "The transpose of a rectangular matrix given as a list of rows.",
        "return [list(r) for r in zip(*m)]",
        ("transpose([[1, 2, 3], [4, 5, 6]])", "[[1, 4], [2, 5], [3, 6]]"),
        ("transpose([[1]])", "[[1]]"),
        ("transpose([[1, 2]])", "[[1], [2]]"),
    ),
    P(
        "to_roman",
        2,
        "def to_roman(n: int) -> str:",
        "The Roman numeral for 1 <= n <= 3999, e.g. 1994 -> 'MCMXCIV'.",
        """
      vals = [(1000, 'M'), (900, 'CM'), (500, 'D'), (400, 'CD'), (100, 'C'), (90, 'XC'),
              (50, 'L'), (40, 'XL'), (10, 'X'), (9, 'IX'), (5, 'V'), (4, 'IV'), (1, 'I')]
      out = ''
      for v, s in vals:
          while n >= v:
              out, n = out + s, n - v
      return out
      """,
        ("to_roman(1994)", "'MCMXCIV'"),
        ("to_roman(4)", "'IV'"),
        ("to_roman(3999)", "'MMMCMXCIX'"),
        ("to_roman(58)", "'LVIII'"),
    ),
    P(
        "from_roman",
        2,
        "def from_roman(s: str) -> int:",
        "The value of a valid Roman numeral, e.g. 'MCMXCIV' -> 1994.",
        """
      v = {'I': 1, 'V': 5, 'X': 10, 'L': 50, 'C': 100, 'D': 500, 'M': 1000}
      total = 0
      for a, b in zip(s, s[1:] + ' '):
          total += -v[a] if b != ' ' and v[a] < v[b] else v[a]
      return total
      """,
        ("from_roman('MCMXCIV')", "1994"),
        ("from_roman('III')", "3"),
        ("from_roman('XLII')", "42"),
        ("from_roman('MMXXIV')", "2024"),
    ),
    P(
        "word_frequencies",
        2,
        "def word_frequencies(text: str) -> dict[str, int]:",
        "Count words in text, lower-cased; a word is a maximal run of letters (anything else separates words).",
        """
      import re
      from collections import Counter
      return dict(Counter(re.findall('[a-z]+', text.lower())))
      """,
        ("word_frequencies('The cat and the hat.')", "{'the': 2, 'cat': 1, 'and': 1, 'hat': 1}"),
        ("word_frequencies('')", "{}"),
        ("word_frequencies('Go, go, GO!')", "{'go': 3}"),
    ),
    P(
        "binary_search",
        2,
        "def binary_search(xs: list[int], target: int) -> int:",
        "Index of target in the sorted list xs of distinct values, or -1 when it is absent.",
        """
      lo, hi = 0, len(xs) - 1
      while lo <= hi:
          mid = (lo + hi) // 2
          if xs[mid] == target:
              return mid
          lo, hi = (mid + 1, hi) if xs[mid] < target else (lo, mid - 1)
      return -1
      """,
        ("binary_search([1, 3, 5, 7, 9], 7)", "3"),
        ("binary_search([1, 3, 5], 4)", "-1"),
        ("binary_search([], 1)", "-1"),
        ("binary_search([2, 4], 2)", "0"),
    ),
    P(
        "rotate_list",
        2,
        "def rotate_list(xs: list, k: int) -> list:",
        "xs rotated right by k positions (k may exceed len(xs)).",
        "return xs[-(k % len(xs)):] + xs[:-(k % len(xs))] if xs and k % len(xs) else list(xs)",
        ("rotate_list([1, 2, 3, 4, 5], 2)", "[4, 5, 1, 2, 3]"),
        ("rotate_list([1, 2, 3], 3)", "[1, 2, 3]"),
        ("rotate_list([1, 2, 3], 4)", "[3, 1, 2]"),
        ("rotate_list([], 2)", "[]"),
    ),
    P(
        "caesar_cipher",
        2,
        "def caesar_cipher(s: str, shift: int) -> str:",
        "Shift every ASCII letter of s by shift places in the alphabet (wrapping, keeping case); other characters stay.",
        """
      def rot(c):
          for base in ('a', 'A'):
              if base <= c <= chr(ord(base) + 25):
                  return chr((ord(c) - ord(base) + shift) % 26 + ord(base))
          return c
      return ''.join(rot(c) for c in s)
      """,
        ("caesar_cipher('abc', 1)", "'bcd'"),
        ("caesar_cipher('Hello, World!', 3)", "'Khoor, Zruog!'"),
        ("caesar_cipher('xyz', 3)", "'abc'"),
        ("caesar_cipher('Abc', -1)", "'Zab'"),
    ),
    P(
        "primes_up_to",
        2,
        "def primes_up_to(n: int) -> list[int]:",
        "All primes p <= n in increasing order.",
        """
      sieve = [True] * (n + 1)
      out = []
      for i in range(2, n + 1):
          if sieve[i]:
              out.append(i)
              for j in range(i * i, n + 1, i):
                  sieve[j] = False
      return out
      """,
        ("primes_up_to(10)", "[2, 3, 5, 7]"),
        ("primes_up_to(1)", "[]"),
        ("primes_up_to(30)[-1]", "29"),
        ("len(primes_up_to(100))", "25"),
    ),
    P(
        "gcd_list",
        2,
        "def gcd_list(xs: list[int]) -> int:",
        "The greatest common divisor of the positive integers in xs.",
        """
      import math
      from functools import reduce
      return reduce(math.gcd, xs)
      """,
        ("gcd_list([12, 18, 24])", "6"),
        ("gcd_list([7])", "7"),
        ("gcd_list([9, 28])", "1"),
    ),
    P(
        "pascal_row",
        2,
        "def pascal_row(n: int) -> list[int]:",
        "Row n of Pascal's triangle (row 0 is [1]).",
        """
      row = [1]
      for _ in range(n):
          row = [a + b for a, b in zip([0] + row, row + [0])]
      return row
      """,
        ("pascal_row(0)", "[1]"),
        ("pascal_row(4)", "[1, 4, 6, 4, 1]"),
        ("pascal_row(6)[3]", "20"),
    ),
    P(
        "two_sum",
        2,
        "def two_sum(nums: list[int], target: int) -> tuple[int, int]:",
        "Indices (i, j), i < j, of the two numbers that add up to target; exactly one such pair exists.",
        """
      seen = {}
      for j, x in enumerate(nums):
          if target - x in seen:
              return (seen[target - x], j)
          seen[x] = j
      """,
        ("two_sum([2, 7, 11, 15], 9)", "(0, 1)"),
        ("two_sum([3, 2, 4], 6)", "(1, 2)"),
        ("two_sum([1, 4, -2, 8], 6)", "(2, 3)"),
    ),
    P(
        "longest_common_prefix",
        2,
        "def longest_common_prefix(words: list[str]) -> str:",
        "The longest string that every word starts with ('' for an empty list).",
        """
      import os
      return os.path.commonprefix(words)
      """,
        ("longest_common_prefix(['flower', 'flow', 'flight'])", "'fl'"),
        ("longest_common_prefix(['dog', 'car'])", "''"),
        ("longest_common_prefix(['same', 'same'])", "'same'"),
        ("longest_common_prefix([])", "''"),
    ),
    P(
        "camel_to_snake",
        2,
        "def camel_to_snake(name: str) -> str:",
        "Convert camelCase or PascalCase to snake_case: 'parseHttpRequest' -> 'parse_http_request'.",
        "return ''.join('_' + c.lower() if c.isupper() and i else c.lower() for i, c in enumerate(name))",
        ("camel_to_snake('parseHttpRequest')", "'parse_http_request'"),
        ("camel_to_snake('MyClass')", "'my_class'"),
        ("camel_to_snake('x')", "'x'"),
    ),
    P(
        "is_valid_ipv4",
        2,
        "def is_valid_ipv4(s: str) -> bool:",
        "True for a dotted-quad IPv4 address: four decimal numbers 0..255 without leading zeros (except '0' itself).",
        """
      parts = s.split('.')
      return len(parts) == 4 and all(p.isdigit() and p.isascii() and int(p) <= 255 and (p == '0' or p[0] != '0') for p in parts)
      """,
        ("is_valid_ipv4('192.168.1.1')", "True"),
        ("is_valid_ipv4('256.1.1.1')", "False"),
        ("is_valid_ipv4('1.2.3')", "False"),
        ("is_valid_ipv4('01.2.3.4')", "False"),
        ("is_valid_ipv4('0.0.0.0')", "True"),
    ),
    P(
        "matrix_multiply",
        2,
        "def matrix_multiply(a: list[list[int]], b: list[list[int]]) -> list[list[int]]:",
        "The matrix product a·b (lists of rows; the shapes are compatible).",
        "return [[sum(x * y for x, y in zip(row, col)) for col in zip(*b)] for row in a]",
        ("matrix_multiply([[1, 2], [3, 4]], [[5, 6], [7, 8]])", "[[19, 22], [43, 50]]"),
        ("matrix_multiply([[1, 2, 3]], [[1], [1], [1]])", "[[6]]"),
        ("matrix_multiply([[2]], [[3, 4]])", "[[6, 8]]"),
    ),
    # ---- difficulty 3 -------------------------------------------------------
    P(
        "merge_intervals",
        3,
        "def merge_intervals(intervals: list[list[int]]) -> list[list[int]]:",
        "Merge overlapping (or touching) closed intervals [start, end]; return them sorted by start.",
        """
      out = []
      for s, e in sorted(intervals):
          if out and s <= out[-1][1]:
              out[-1][1] = max(out[-1][1], e)
          else:
              out.append([s, e])
      return out
      """,
        ("merge_intervals([[1, 3], [2, 6], [8, 10], [15, 18]])", "[[1, 6], [8, 10], [15, 18]]"),
        ("merge_intervals([[1, 4], [4, 5]])", "[[1, 5]]"),
        ("merge_intervals([[5, 7], [1, 2]])", "[[1, 2], [5, 7]]"),
        ("merge_intervals([[1, 10], [2, 3]])", "[[1, 10]]"),
    ),
    P(
        "lru_cache",
        3,
        "class LRUCache:",
        """
      A least-recently-used cache of fixed capacity.

      LRUCache(capacity) creates it; get(key) returns the value or -1 when
      absent (and marks the key as recently used); put(key, value) inserts or
      updates, evicting the least recently used key when over capacity, and
      returns None.
      """,
        """
      def __init__(self, capacity):
          from collections import OrderedDict
          self.capacity, self.data = capacity, OrderedDict()

      def get(self, key):
          if key not in self.data:
              return -1
          self.data.move_to_end(key)
          return self.data[key]

      def put(self, key, value):
          self.data[key] = value
          self.data.move_to_end(key)
          if len(self.data) > self.capacity:
              self.data.popitem(last=False)
      """,
        ("_run(LRUCache, [('put', 1, 1), ('put', 2, 2), ('get', 1), ('put', 3, 3), ('get', 2)], 2)", "[None, None, 1, None, -1]"),
        ("_run(LRUCache, [('get', 7)], 1)", "[-1]"),
        ("_run(LRUCache, [('put', 1, 1), ('put', 1, 5), ('put', 2, 2), ('get', 1), ('get', 2)], 2)", "[None, None, None, 5, 2]"),
        (
            "_run(LRUCache, [('put', 'a', 1), ('put', 'b', 2), ('get', 'a'), ('put', 'c', 3), ('get', 'b'), ('get', 'a')], 2)",
            "[None, None, 1, None, -1, 1]",
        ),
        helpers=_STACK_HELPERS,
        wrong_body="""
      def __init__(self, capacity):
          pass

      def get(self, key):
          return None

      def put(self, key, value):
          return -1
      """,
    ),
    P(
        "min_stack",
        3,
        "class MinStack:",
        """
      A stack that also reports its minimum in O(1).

      MinStack() creates an empty stack; push(x) returns None; pop() removes
      and returns the top; top() returns the top; get_min() returns the
      smallest element on the stack.
      """,
        """
      def __init__(self):
          self.items = []

      def push(self, x):
          self.items.append((x, min(x, self.items[-1][1]) if self.items else x))

      def pop(self):
          return self.items.pop()[0]

      def top(self):
          return self.items[-1][0]

      def get_min(self):
          return self.items[-1][1]
      """,
        ("_run(MinStack, [('push', 3), ('push', 1), ('push', 2), ('get_min',)])", "[None, None, None, 1]"),
        ("_run(MinStack, [('push', 3), ('push', 1), ('pop',), ('get_min',), ('top',)])", "[None, None, 1, 3, 3]"),
        (
            "_run(MinStack, [('push', -2), ('push', 0), ('push', -3), ('get_min',), ('pop',), ('top',), ('get_min',)])",
            "[None, None, None, -3, -3, 0, -2]",
        ),
        helpers=_STACK_HELPERS,
        wrong_body="""
      def __init__(self):
          pass

      def push(self, x):
          return x

      def pop(self):
          return None

      def top(self):
          return None

      def get_min(self):
          return None
      """,
    ),
    P(
        "evaluate_rpn",
        3,
        "def evaluate_rpn(tokens: list[str]) -> int:",
        "Evaluate integer Reverse Polish Notation with + - * /; division truncates toward zero.",
        """
      stack = []
      for t in tokens:
          if t in ('+', '-', '*', '/'):
              b, a = stack.pop(), stack.pop()
              stack.append(a + b if t == '+' else a - b if t == '-' else a * b if t == '*' else int(a / b))
          else:
              stack.append(int(t))
      return stack[0]
      """,
        ("evaluate_rpn(['2', '1', '+', '3', '*'])", "9"),
        ("evaluate_rpn(['4', '13', '5', '/', '+'])", "6"),
        ("evaluate_rpn(['7', '-2', '/'])", "-3"),
        ("evaluate_rpn(['5'])", "5"),
    ),
    P(
        "longest_increasing_subsequence",
        3,
        "def longest_increasing_subsequence(xs: list[int]) -> int:",
        "Length of the longest strictly increasing subsequence of xs.",
        """
      import bisect
      tails = []
      for x in xs:
          i = bisect.bisect_left(tails, x)
          tails[i:i + 1] = [x]
      return len(tails)
      """,
        ("longest_increasing_subsequence([10, 9, 2, 5, 3, 7, 101, 18])", "4"),
        ("longest_increasing_subsequence([])", "0"),
        ("longest_increasing_subsequence([7, 7, 7])", "1"),
        ("longest_increasing_subsequence([1, 2, 3, 4])", "4"),
    ),
    P(
        "edit_distance",
        3,
        "def edit_distance(a: str, b: str) -> int:",
        "Levenshtein distance: the fewest single-character insertions, deletions or substitutions turning a into b.",
        """
      prev = list(range(len(b) + 1))
      for i, ca in enumerate(a, 1):
          cur = [i]
          for j, cb in enumerate(b, 1):
              cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
          prev = cur
      return prev[-1]
      """,
        ("edit_distance('kitten', 'sitting')", "3"),
        ("edit_distance('', 'abc')", "3"),
        ("edit_distance('flaw', 'lawn')", "2"),
        ("edit_distance('same', 'same')", "0"),
    ),
    P(
        "spiral_order",
        3,
        "def spiral_order(m: list[list[int]]) -> list[int]:",
        "The elements of a rectangular matrix in clockwise spiral order, starting at the top-left.",
        """
      out = []
      m = [list(r) for r in m]
      while m:
          out += m.pop(0)
          m = [list(r) for r in zip(*m)][::-1]
      return out
      """,
        ("spiral_order([[1, 2, 3], [4, 5, 6], [7, 8, 9]])", "[1, 2, 3, 6, 9, 8, 7, 4, 5]"),
        ("spiral_order([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]])", "[1, 2, 3, 4, 8, 12, 11, 10, 9, 5, 6, 7]"),
        ("spiral_order([[1], [2]])", "[1, 2]"),
        ("spiral_order([])", "[]"),
    ),
    P(
        "top_k_frequent",
        3,
        "def top_k_frequent(words: list[str], k: int) -> list[str]:",
        "The k most frequent words, most frequent first; ties in alphabetical order.",
        """
      from collections import Counter
      return [w for w, _ in sorted(Counter(words).items(), key=lambda kv: (-kv[1], kv[0]))[:k]]
      """,
        ("top_k_frequent(['a', 'b', 'a', 'c', 'b', 'a'], 2)", "['a', 'b']"),
        ("top_k_frequent(['x', 'y', 'z'], 2)", "['x', 'y']"),
        ("top_k_frequent(['b', 'a', 'b', 'a', 'c'], 3)", "['a', 'b', 'c']"),
    ),
    P(
        "parse_duration",
        3,
        "def parse_duration(s: str) -> int:",
        "Seconds in a duration like '1h30m', '45s' or '2h5s' (units h, m, s, each at most once, in that order).",
        """
      import re
      h, m, sec = re.fullmatch(r'(?:(\\d+)h)?(?:(\\d+)m)?(?:(\\d+)s)?', s).groups()
      return int(h or 0) * 3600 + int(m or 0) * 60 + int(sec or 0)
      """,
        ("parse_duration('1h30m')", "5400"),
        ("parse_duration('45s')", "45"),
        ("parse_duration('2h5s')", "7205"),
        ("parse_duration('1h1m1s')", "3661"),
    ),
    P(
        "number_to_words",
        3,
        "def number_to_words(n: int) -> str:",
        "English words for 0 <= n <= 999, e.g. 342 -> 'three hundred forty-two', 7 -> 'seven', 100 -> 'one hundred'.",
        """
      ones = ('zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen '
              'sixteen seventeen eighteen nineteen').split()
      tens = 'twenty thirty forty fifty sixty seventy eighty ninety'.split()
      def below100(k):
          if k < 20:
              return ones[k]
          return tens[k // 10 - 2] + ('-' + ones[k % 10] if k % 10 else '')
      if n < 100:
          return below100(n)
      return ones[n // 100] + ' hundred' + (' ' + below100(n % 100) if n % 100 else '')
      """,
        ("number_to_words(342)", "'three hundred forty-two'"),
        ("number_to_words(7)", "'seven'"),
        ("number_to_words(100)", "'one hundred'"),
        ("number_to_words(0)", "'zero'"),
        ("number_to_words(915)", "'nine hundred fifteen'"),
    ),
    P(
        "coin_change",
        3,
        "def coin_change(coins: list[int], amount: int) -> int:",
        "The fewest coins (unlimited supply of each denomination) summing to amount, or -1 when impossible.",
        """
      best = [0] + [amount + 1] * amount
      for a in range(1, amount + 1):
          for c in coins:
              if c <= a:
                  best[a] = min(best[a], best[a - c] + 1)
      return best[amount] if best[amount] <= amount else -1
      """,
        ("coin_change([1, 2, 5], 11)", "3"),
        ("coin_change([2], 3)", "-1"),
        ("coin_change([1], 0)", "0"),
        ("coin_change([3, 7], 20)", "4"),
    ),
    P(
        "topological_order",
        3,
        "def topological_order(deps: dict[str, list[str]]) -> list[str]:",
        """
      Order the nodes so that every node comes after the nodes it depends on.
      deps maps a node to its dependencies (every node is a key). When several
      nodes are ready, take the alphabetically smallest first.
      """,
        """
      import heapq
      waiting = {n: set(d) for n, d in deps.items()}
      ready = [n for n, d in waiting.items() if not d]
      heapq.heapify(ready)
      out = []
      while ready:
          n = heapq.heappop(ready)
          out.append(n)
          for m, d in waiting.items():
              if n in d:
                  d.discard(n)
                  if not d:
                      heapq.heappush(ready, m)
      return out
      """,
        ("topological_order({'a': [], 'b': ['a'], 'c': ['a']})", "['a', 'b', 'c']"),
        ("topological_order({'app': ['lib', 'log'], 'lib': ['log'], 'log': []})", "['log', 'lib', 'app']"),
        ("topological_order({'z': [], 'y': []})", "['y', 'z']"),
    ),
    P(
        "valid_sudoku",
        3,
        "def valid_sudoku(board: list[str]) -> bool:",
        """
      board is 9 strings of 9 characters, digits '1'-'9' or '.' for empty.
      True when no digit repeats within a row, a column or a 3x3 box.
      """,
        """
      groups = [[(r, c) for c in range(9)] for r in range(9)] + [[(r, c) for r in range(9)] for c in range(9)]
      groups += [[(br + r, bc + c) for r in range(3) for c in range(3)] for br in (0, 3, 6) for bc in (0, 3, 6)]
      for g in groups:
          digits = [board[r][c] for r, c in g if board[r][c] != '.']
          if len(digits) != len(set(digits)):
              return False
      return True
      """,
        ("valid_sudoku(_BOARD)", "True"),
        ("valid_sudoku(['83..7....'] + _BOARD[1:])", "False"),  # two 8s in the first column
        ("valid_sudoku(['.........'] * 9)", "True"),
        ("valid_sudoku(['1........', '.1.......'] + ['.........'] * 7)", "False"),
        helpers="_BOARD = ['53..7....', '6..195...', '.98....6.', '8...6...3', '4..8.3..1', '7...2...6', '.6....28.', "
        "'...419..5', '....8..79']\n",
    ),
]


def problems() -> list[Problem]:
    return list(_PROBLEMS)


def to_task(p: Problem, run_id: str, group_size: int, index: int) -> Task:
    data = {"suite": SUITE, "tests": p.tests, "style": "functions", "reward": "fraction"}
    return suite_task(SUITE, p, run_id, group_size, index, prompt=p.prompt, max_tokens=1024,
                      verifier=VerifierSpec(kind="python_tests", data=data))  # fmt: skip
